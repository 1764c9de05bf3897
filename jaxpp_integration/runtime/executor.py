"""The single-host runtime: walks a compiled `Program` and dispatches it asynchronously.

One Python thread issues every instruction in program order; JAX's asynchronous dispatch lets
groups run concurrently (a task waits only on its inputs). Transfers copy each shard to the
target group's matching device (runs of consecutive transfers in one runtime call,
`jax_compat.copy_shards`; `jax.device_put` when the layouts differ); transfers to another
process go by batches, one collective program each (`transfer.py`); deletes free buffers
deterministically.

Each step returns the logical memory report of `memory.replay` (bytes alive per group after
every instruction, from shapes in program order) and, when asked, measured per-task start/end
times. `measuring_device_bytes()` checks the logical figures: inside it, every step also records
the bytes of the device buffers actually alive per device after each instruction (slow; off
unless that context is active).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time

import jax

from jaxpp_integration.compiler.program import Delete, Fill, Program, Run, Transfer
from jaxpp_integration.jax_compat import copy_shards, same_shard_layout
from jaxpp_integration.runtime.transfer import plan_cross_process
from jaxpp_integration.tools import memory


def execute(
    prog: Program,
    executables,
    slot_sharding,
    inputs: dict,
    *,
    record_times=False,
    local_ranks=None,
    watchdog=None,
):
    """Runs `prog`. `inputs` maps input slots to arrays already on their groups.

    Multi-controller: only `local_ranks` run here; transfers between a local and a remote group
    are collectives both processes issue in program order, one per batch (`prepare`). The byte
    accounting is kept for every group alike (computed from shapes, not read off devices). A
    `watchdog` (several processes, `pipeline_hang_timeout_s`) is told each instruction as it is
    dispatched and is handed every cross-process batch's result."""
    if local_ranks is None:
        local_ranks = frozenset(range(prog.mpmd_dim))
    regs: list = [None] * len(prog.slot_rank)
    for s, v in inputs.items():
        regs[s] = v
    for s, v in prog.constants_on_device.items():
        regs[s] = v
    events = []
    if watchdog is not None:
        watchdog.start()
    probe = _DEVICE_PROBE.get()
    if probe is not None:
        probe.begin(inputs.values())
    for idx, ins in enumerate(prog.instrs):
        if watchdog is not None:
            watchdog.enter(idx)
        if isinstance(ins, Run) and ins.code.rank in local_ranks:
            t0 = time.perf_counter() if record_times else 0.0
            outs = executables[idx](*[regs[s] for s in ins.ins])
            if record_times:
                jax.block_until_ready(outs)
                events.append((ins.code.rank, ins.name, ins.code, t0, time.perf_counter()))
            for s, v in zip(ins.outs, outs):
                regs[s] = v
        elif isinstance(ins, Transfer):
            src_here, dst_here = ins.src_rank in local_ranks, ins.dst_rank in local_ranks
            if src_here and dst_here:
                batch = prog.transfer_batches.get(idx)
                if batch is not None:  # one call for a run of local transfers
                    srcs = [regs[t.src] for t in batch]
                    dsts = [slot_sharding[t.dst] for t in batch]
                    fast = prog.transfer_fast[idx]
                    moved = copy_shards(srcs, dsts) if fast else jax.device_put(srcs, dsts)
                    for t, v in zip(batch, moved):
                        regs[t.dst] = v
            elif (src_here or dst_here) and idx in prog.cross_batches:
                issued = _cross_process(prog.cross_batches[idx], regs)
                if watchdog is not None:
                    watchdog.watch(idx, issued)
        elif isinstance(ins, Fill):
            if ins.rank in local_ranks:  # a fresh buffer (on CPU it could alias host memory
                # the program keeps, which the first accumulation then could not donate)
                regs[ins.slot] = jax.device_put(ins.value, slot_sharding[ins.slot], may_alias=False)
        elif isinstance(ins, Delete):
            v = regs[ins.slot]
            if v is not None and not ins.donated and not v.is_deleted():
                v.delete()
            regs[ins.slot] = None
        if probe is not None:
            probe.record()
    if watchdog is not None:
        watchdog.leave()
    outputs = [{r: regs[s] for r, s in slots.items()} for slots in prog.outputs]
    report = memory.replay(prog, prog.slot_bytes, input_slots=inputs)
    return outputs, report, events


def _cross_process(planned, regs):
    """Runs one batch of cross-process transfers (`transfer.plan_cross_process`): reads the sent
    values, stores the received ones; returns the collective's output (for the watchdog). The
    batch's later transfers are not in `prog.cross_batches`, so the walk skips them."""
    transfers, batch = planned
    received, issued = batch([regs[t.src] for t in transfers] if batch.sending else None)
    if received is not None:
        for t, v in zip(transfers, received):
            regs[t.dst] = v
    return issued


@dataclasses.dataclass
class DeviceBytes:
    """Bytes of device buffers alive per device id after each instruction of the steps run
    inside `measuring_device_bytes()` (one list per step). Counted: the step's inputs and every
    buffer made during the step; not counted: buffers that were alive before the step and are
    not its inputs (the caller's other arrays, the program's constants). Each buffer once, even
    if several arrays share it."""

    steps: list = dataclasses.field(default_factory=list)
    _before: dict = dataclasses.field(default_factory=dict)  # buffer -> array kept alive

    def begin(self, inputs) -> None:
        taken = {key for x in inputs for key, _ in _buffers(x)}
        # hold the arrays alive before the step, so no new buffer can reuse their addresses
        self._before = {key: a for a in jax.live_arrays() for key, _ in _buffers(a)}
        for key in taken:
            self._before.pop(key, None)
        self.steps.append([])

    def record(self) -> None:
        per_device: dict = {}
        seen = set(self._before)
        for a in jax.live_arrays():
            for key, nbytes in _buffers(a):
                if key not in seen:
                    seen.add(key)
                    per_device[key[0]] = per_device.get(key[0], 0) + nbytes
        self.steps[-1].append(per_device)


def _buffers(a):
    """((device id, buffer address), bytes) of each of a live array's device buffers."""
    if a.is_deleted():
        return []
    out = []
    for shard in a.addressable_shards:
        buf = shard.data
        out.append(((shard.device.id, buf.unsafe_buffer_pointer()), buf.nbytes))
    return out


_DEVICE_PROBE: contextvars.ContextVar[DeviceBytes | None] = contextvars.ContextVar(
    "jaxpp_device_probe", default=None
)


@contextlib.contextmanager
def measuring_device_bytes():
    """Inside this context every step also measures device buffers after each instruction (a
    scan of `jax.live_arrays()` each time, which waits for every task: for tests and
    diagnostics only). Yields the `DeviceBytes` that collects them."""
    probe = DeviceBytes()
    token = _DEVICE_PROBE.set(probe)
    try:
        yield probe
    finally:
        _DEVICE_PROBE.reset(token)


def prepare(prog: Program, slot_sharding, local_ranks, owners=None, mpmd_axis=None) -> None:
    """Puts the program's constants on this process's groups once, sizes every slot, groups
    runs of consecutive local transfers so each run is one copy call, and (several processes:
    `owners[r]` is the process of group r) plans the batches of cross-process transfers, which
    compiles their programs and allocates their receive buffers."""
    prog.slot_bytes = [memory.slot_nbytes(a) for a in prog.slot_aval]
    prog.slot_producer = {s: ins for ins in prog.instrs if isinstance(ins, Run) for s in ins.outs}
    prog.transfer_batches = {}
    start = None
    for idx, ins in enumerate(prog.instrs):
        local = (
            isinstance(ins, Transfer)
            and ins.src_rank in local_ranks
            and ins.dst_rank in local_ranks
        )
        if local and start is None:
            start = idx
            prog.transfer_batches[start] = [ins]
        elif local:
            prog.transfer_batches[start].append(ins)
        else:
            start = None
    prog.transfer_fast = {
        start: all(
            same_shard_layout(
                slot_sharding[t.src], slot_sharding[t.dst], prog.slot_aval[t.src].shape
            )
            for t in batch
        )
        for start, batch in prog.transfer_batches.items()
    }
    prog.cross_batches = {}
    if owners is not None and len(set(owners)) > 1:
        prog.cross_batches = plan_cross_process(prog, slot_sharding, owners, local_ranks, mpmd_axis)
    prog.constants_on_device = {
        s: jax.device_put(v, slot_sharding[s])
        for s, v in prog.constants.items()
        if prog.slot_rank[s] in local_ranks
    }
