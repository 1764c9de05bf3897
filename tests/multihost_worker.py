"""One process of the 2-process engine test: run a pipelined step, compare with local jax.jit.

Usage: python multihost_worker.py PROCESS_ID PORT SCHEDULE [die | stop]
Prints 'OK <n>' after checking n arrays bitwise against a single-process reference, and before it
'COUNTS <json>' (with a fresh persistent compilation cache in $MULTIHOST_CACHE_DIR):
- the XLA compiles `.compile()` ran here (`jax.monitoring`, cache reads not counted), the
  engine's task compiles, the groups of the compiled task programs and whether their devices
  are all this process's;
- for every batch of cross-process transfers run in one step: which side this process was, how
  many values and scalars it moved, the programs it launched (`jax.stages.Compiled` calls), the
  XLA compiles it triggered and the host arrays it put on a device (`jax.device_put` counted;
  the batch runs under `jax.transfer_guard_host_to_device("disallow_explicit")`), the bytes a
  sender keeps from it and the device order of its pair program;
- the XLA compiles and persistent-cache reads of compiling the step again.
With `die`, process 1 kills itself (SIGKILL) after compiling, to test that its peer exits instead
of hanging. With `stop`, process 1 stops itself (SIGSTOP) after compiling and the step runs with
`pipeline_hang_timeout_s=HANG_TIMEOUT_S` (heartbeats allowed far longer), to test the watchdog.
"""

from __future__ import annotations

import os
import sys

import jax

pid, port, schedule_name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
mode = sys.argv[4] if len(sys.argv) > 4 else ""
HANG_TIMEOUT_S = 5.0
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 1)
heartbeat = 120 if mode == "stop" else 10
if mode == "" or "MULTIHOST_CACHE_DIR" in os.environ:
    # compiles are counted: a fresh persistent cache shared by the two processes; with `die`, the
    # cache a counted run of the same schedule filled, if the test has one (what it tests comes
    # after compiling)
    jax.config.update("jax_compilation_cache_dir", os.environ["MULTIHOST_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
else:
    jax.config.update("jax_enable_compilation_cache", False)
jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, heartbeat_timeout_seconds=heartbeat)

import contextlib  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402
from compare import reordered_sum_rtol  # noqa: E402
from engine_models import clipping_sgd, make_step, tied_mlp_setup  # noqa: E402

import jaxpp_integration as jaxpp  # noqa: E402
from jaxpp_integration.compiler.program import Transfer  # noqa: E402
from jaxpp_integration.runtime import transfer  # noqa: E402

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
xla_compiles = [0]
launches = [0]
host_puts = [0]
batches: list[dict] = []
program_batches: set = set()  # ids of the step program's batches (the others move step inputs)


cache_hits = [0]


def _on_duration(event, duration, **_):
    if event == BACKEND_COMPILE:
        xla_compiles[0] += 1


def _on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
        cache_hits[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)
_compiled_call = jax.stages.Compiled.__call__
_device_put = jax.device_put
_batch_call = transfer.CrossBatch.__call__


def _counted_call(self, *args, **kwargs):
    launches[0] += 1
    return _compiled_call(self, *args, **kwargs)


def _counted_put(x, *args, **kwargs):
    if any(not isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x)):
        host_puts[0] += 1
    return _device_put(x, *args, **kwargs)


def _counted_batch(self, values):
    before = (launches[0], xla_compiles[0], host_puts[0])
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        out = _batch_call(self, values)
    received, issued = out
    batches.append(
        {
            "of": "program" if id(self) in program_batches else "inputs",
            "side": "send" if self.sending else "receive",
            "values": len(self.links),
            "scalars": sum(len(g) for g in self.scalars),
            "launches": launches[0] - before[0],
            "compiles": xla_compiles[0] - before[1],
            "host_puts": host_puts[0] - before[2],
            # what the batch hands back beyond the received values (a sender: all it keeps)
            "kept_bytes": 0 if received is not None else _nbytes(issued),
            "pair_devices": [d.id for d in self.pair_shardings[0].sharding.mesh.devices.flat],
        }
    )
    return out


def _nbytes(tree) -> int:
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards)


@contextlib.contextmanager
def counting_transfers():
    jax.stages.Compiled.__call__ = _counted_call
    jax.device_put = _counted_put
    transfer.CrossBatch.__call__ = _counted_batch
    try:
        yield
    finally:
        jax.stages.Compiled.__call__ = _compiled_call
        jax.device_put = _device_put
        transfer.CrossBatch.__call__ = _batch_call


def _swapped():
    """Valid on one process, but rank 1 runs each pair of forwards in the opposite order to the
    one rank 0 sends them in (microbatch 1 before 0, 3 before 2): a runtime walking each rank's
    list on its own would pair the two processes' transfers wrongly. Every process here walks one
    global order, so the transfers pair up."""
    from jaxpp_integration.schedules import Phase, Task

    f, b = Phase.FWD, Phase.BWD
    rank0 = [Task(0, i, f) for i in range(4)] + [Task(0, i, b) for i in range(4)]
    rank1 = [Task(1, i, f) for i in (1, 0, 3, 2)] + [Task(1, i, b) for i in range(4)]
    return jaxpp.UserSchedule([rank0, rank1], num_stages=2, mpmd_dim=2)


schedule = {
    "1f1b": lambda: jaxpp.Std1F1B(2),
    "interleaved": lambda: jaxpp.Interleaved1F1B(num_stages=4, mpmd_dim=2),
    "swapped": _swapped,
}[schedule_name]()
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 1), ("stage", "fsdp"))
mpmd_mesh = jaxpp.MpmdMesh(mesh, "stage")
params, batch, loss_fn = tied_mlp_setup(schedule.num_stages, 4)
opt = clipping_sgd()
step = make_step(loss_fn, opt, schedule)
opt_state = opt.init(params)
jax.block_until_ready(opt_state)
xla_compiles[0] = cache_hits[0] = 0
compiled = jaxpp.mpmd_jit_with_loop(
    step,
    mpmd_mesh=mpmd_mesh,
    pipeline_hang_timeout_s=HANG_TIMEOUT_S if mode == "stop" else None,
).compile(params, opt_state, batch)
if mode == "stop" and pid == 1:
    import os
    import signal

    print("process 1: stopping myself", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
if mode == "stop":  # process 0: straight into the step, which waits on process 1 forever
    out = compiled(params, opt_state, batch)
    jax.block_until_ready([a for leaf in jax.tree.leaves(out) for a in leaf.arrays.values()])
    print("process 0: the step finished although process 1 is stopped", flush=True)
    sys.exit(0)
if mode == "die" and pid == 1:
    import os
    import signal

    print("process 1: killing myself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
compile_xla = xla_compiles[0] - cache_hits[0]  # the event also marks persistent-cache reads
program_batches.update(id(b) for _, b in compiled.walk.cross_batches.values())
ref_step = jax.jit(step)
r = (params, opt_state)
p = r
losses, ref_losses = [], []
for k in range(3):
    with jax.default_device(jax.local_devices()[0]):
        r_out = ref_step(*r, batch)
    with counting_transfers() if k == 2 else contextlib.nullcontext():  # a step's batches
        p_out = compiled(*p, batch)
    r, p = r_out[:2], p_out[:2]
    losses.append(p_out[2])
    ref_losses.append(r_out[2])
local_devices = set(jax.local_devices())
counts = {
    "xla_compiles": compile_xla,
    "task_compiles": compiled.compile_stats.compiles,
    "task_loads": compiled.compile_stats.loads,
    "task_groups": sorted({compiled.program.instrs[i].code.rank for i in compiled.executables}),
    "task_devices_local": all(
        sh.device_set <= local_devices
        for exe in compiled.executables.values()
        for sh in (*exe.input_shardings[0], *exe.output_shardings)
    ),
    "transfers": sum(isinstance(i, Transfer) for i in compiled.program.instrs),
    "batches": batches,
}
# compiling again reads every task program from the persistent cache, on both processes (each
# process writes the programs only it compiles); transfer programs are kept in memory
xla_compiles[0] = cache_hits[0] = 0
again = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh).compile(params, opt_state, batch)
counts["again"] = {"real_compiles": xla_compiles[0] - cache_hits[0], "cache_hits": cache_hits[0]}
print("COUNTS " + json.dumps(counts), flush=True)
checked = 0
for ref, got in zip(jax.tree.leaves(r_out), jax.tree.leaves(p_out), strict=True):
    for arr in got.arrays.values():
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(arr))
        checked += 1


def assert_same_loss(value, want):
    """Bitwise, except for `swapped`: its last stage runs the forwards, and so adds the 4
    microbatch losses, in the order 1, 0, 3, 2 where `jax.jit` adds 0, 1, 2, 3 (a sum of 4
    positive terms in another order: within 3 EPS32 of it, tests/compare.py); its gradients are
    added in the backwards' order, the same as `jax.jit`'s, and the state compares bitwise."""
    if schedule_name == "swapped":
        np.testing.assert_allclose(value, np.asarray(want), rtol=reordered_sum_rtol(4, False))
    else:
        np.testing.assert_array_equal(value, np.asarray(want))


# the loss lives on the last group only; fetch broadcasts it to every process
assert_same_loss(jaxpp.fetch(p_out[2]), r_out[2])
# the three steps' losses (and a host value) read back in one go: one collective, bitwise
from jax.experimental import multihost_utils  # noqa: E402

from jaxpp_integration.runtime import fetch as fetch_mod  # noqa: E402

calls = {"gather": 0, "broadcast": 0}
real_gather, real_broadcast = fetch_mod._gather_program, multihost_utils.broadcast_one_to_all


def _counted_gather(*args):
    program = real_gather(*args)

    def run(x):
        calls["gather"] += 1
        return program(x)

    return run


def _counted_broadcast(*args, **kwargs):
    calls["broadcast"] += 1
    return real_broadcast(*args, **kwargs)


fetch_mod._gather_program = _counted_gather
multihost_utils.broadcast_one_to_all = _counted_broadcast
read = jaxpp.fetch_later({"loss": losses, "host": np.int32(7)})
got = read.result()
for want, value in zip(ref_losses, got["loss"], strict=True):
    assert_same_loss(value, want)
assert got["host"] == 7
print("FETCH " + json.dumps(calls), flush=True)
print(f"OK {checked} local arrays; groups here: {sorted(compiled.local_ranks)}", flush=True)
