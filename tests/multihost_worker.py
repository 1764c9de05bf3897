"""One process of the 2-process engine test: run a pipelined step, compare with local jax.jit.

Usage: python multihost_worker.py PROCESS_ID PORT SCHEDULE [die | stop]
Prints 'OK <n>' after checking n arrays bitwise against a single-process reference. With `die`,
process 1 kills itself (SIGKILL) after compiling, to test that its peer exits instead of hanging.
With `stop`, process 1 stops itself (SIGSTOP) after compiling and the step runs with
`pipeline_hang_timeout_s=HANG_TIMEOUT_S` (heartbeats allowed far longer), to test the watchdog.
"""

from __future__ import annotations

import sys

import jax

pid, port, schedule_name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
mode = sys.argv[4] if len(sys.argv) > 4 else ""
HANG_TIMEOUT_S = 5.0
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 1)
heartbeat = 120 if mode == "stop" else 10
jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, heartbeat_timeout_seconds=heartbeat)

import numpy as np  # noqa: E402
from engine_models import clipping_sgd, make_step, tied_mlp_setup  # noqa: E402

import jaxpp_integration as jaxpp  # noqa: E402


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
compiled = jaxpp.mpmd_jit_with_loop(
    step,
    mpmd_mesh=mpmd_mesh,
    pipeline_hang_timeout_s=HANG_TIMEOUT_S if mode == "stop" else None,
).compile(params, opt.init(params), batch)
if mode == "stop" and pid == 1:
    import os
    import signal

    print("process 1: stopping myself", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
if mode == "stop":  # process 0: straight into the step, which waits on process 1 forever
    out = compiled(params, opt.init(params), batch)
    jax.block_until_ready([a for leaf in jax.tree.leaves(out) for a in leaf.arrays.values()])
    print("process 0: the step finished although process 1 is stopped", flush=True)
    sys.exit(0)
if mode == "die" and pid == 1:
    import os
    import signal

    print("process 1: killing myself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
ref_step = jax.jit(step)
r = (params, opt.init(params))
p = r
for _ in range(3):
    with jax.default_device(jax.local_devices()[0]):
        r_out = ref_step(*r, batch)
    p_out = compiled(*p, batch)
    r, p = r_out[:2], p_out[:2]
checked = 0
for ref, got in zip(jax.tree.leaves(r_out), jax.tree.leaves(p_out), strict=True):
    for arr in got.arrays.values():
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(arr))
        checked += 1
# the loss lives on the last group only; fetch broadcasts it to every process
loss = jaxpp.fetch(p_out[2])
np.testing.assert_array_equal(loss, np.asarray(r_out[2]))
print(f"OK {checked} local arrays; groups here: {sorted(compiled.local_ranks)}", flush=True)
