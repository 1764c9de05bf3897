"""The single-host runtime: walks a compiled `Program` and dispatches it asynchronously.

One Python thread issues every instruction in program order; JAX's asynchronous dispatch lets
groups run concurrently (a task waits only on its inputs). Transfers copy each shard to the
target group's matching device (runs of consecutive transfers in one runtime call,
`jax_compat.shard_copier`; `jax.device_put` when the layouts differ); transfers to another
process go by batches, one collective program each (`transfer.py`); runs of consecutive fills
are one compiled program each, making the accumulators on the device (`fills.py`).

Everything constant per compiled program is worked out once (`prepare` -> `Walk`): the
executable, input and output slots of every task, the transfer batches, and the releases. A
`Delete` is folded into the instruction before it: the runtime drops its reference to the
value, which frees the buffer then and there (nothing else holds the engine's own values); only
a step input the caller donated, which the caller may still reference, is deleted explicitly.
The logical memory report (`tools.memory`) is a property of the program, computed once.

Device-bytes measurement (`execute(..., probe=DeviceBytes(...))`, the trainer's first step):
the bytes of the buffers alive on every device after each instruction, tracked from the
program's own allocation and free events (each value's shard bytes per device, from its
sharding; a donated input counts as freed once JAX marks it deleted), so it costs
O(instructions) and waits for nothing. It is checked once against the device buffers actually
alive (a scan of `jax.live_arrays()`) at the instruction where the program's logical peak is
(plus one scan before the step, to leave out what was alive before it);
`scanning_device_bytes()` is the former per-instruction scan, kept for tests and debugging.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time

import jax

from jaxpp_integration.compiler.program import Delete, Fill, Program, Run, Transfer
from jaxpp_integration.jax_compat import same_shard_layout, shard_copier
from jaxpp_integration.runtime.fills import FillPrograms
from jaxpp_integration.runtime.transfer import plan_cross_process
from jaxpp_integration.tools import memory

_RUN, _COPY, _CROSS, _FILL, _RELEASE = range(5)


@dataclasses.dataclass
class Op:
    """One step of the walk: an instruction (or a run of local transfers) and the releases that
    follow it. `drop`: slots whose value the runtime lets go of; `kill`: step inputs the caller
    donated, deleted explicitly; `deletes`: (instruction index, slot) of the folded Deletes."""

    kind: int
    index: int  # the (first) instruction's index
    args: tuple
    drop: tuple = ()
    kill: tuple = ()
    deletes: tuple = ()


@dataclasses.dataclass
class Walk:
    """What `execute` needs of one compiled program on this process, computed once."""

    prog: Program
    executables: dict  # instruction index -> executable (the compiled function's own dict)
    ops: list
    constants: dict  # slot -> array on its group's devices
    slot_sharding: dict
    local_ranks: frozenset
    input_slots: tuple  # the step inputs this process holds
    slot_device_bytes: list  # per slot: ((device id, bytes), ...)
    mpmd_axis: str | None = None
    cross_batches: dict = dataclasses.field(default_factory=dict)  # see `prepare`
    _memory: memory.MemoryReport | None = None
    _check_at: int | None = None

    @property
    def memory(self) -> memory.MemoryReport:
        """Logical bytes per group over a step (whole arrays; step inputs of this process)."""
        if self._memory is None:
            nbytes = [memory.slot_nbytes(a) for a in self.prog.slot_aval]
            self._memory = memory.replay(self.prog, nbytes, input_slots=self.input_slots)
        return self._memory

    def device_peak_index(self) -> int:
        """The instruction after which a device of this process holds the most logical bytes
        (the largest device of each group; the first such instruction); computed once."""
        if self._check_at is None:
            largest = [max((b for _, b in p), default=0) for p in self.slot_device_bytes]
            report = memory.replay(self.prog, largest, input_slots=self.input_slots)
            group = max(self.local_ranks, key=lambda r: (report.peak_bytes[r], -r))
            self._check_at = report.peak_index[group]
        return self._check_at


def prepare(
    prog: Program, executables, slot_sharding, local_ranks, mpmd_axis=None, owners=None
) -> Walk:
    """Puts the program's constants on this process's groups once and turns its instructions
    into the ops `execute` walks (see the module docstring), compiling the fill programs
    (`fills.py`). Several processes (`owners[r]`: the process of group r): plans the batches of
    cross-process transfers (`transfer.plan_cross_process`), which compiles their programs and
    allocates their receive buffers; a batch runs at its first transfer."""
    local = frozenset(local_ranks)
    cross = {}
    if owners is not None and len(set(owners)) > 1:
        cross = plan_cross_process(prog, slot_sharding, owners, local, mpmd_axis)
    fills = FillPrograms()
    input_slots = {s for slots in prog.inputs for r, s in slots.items() if r in local}
    caller_donated = input_slots  # an input the program deletes was donated by the caller
    ops: list = []
    current: Op | None = None  # the op the following Deletes fold into
    instrs = prog.instrs
    idx = 0
    while idx < len(instrs):
        ins = instrs[idx]
        op = None
        if isinstance(ins, Run):
            if ins.code.rank in local:
                op = Op(_RUN, idx, (ins.ins, ins.outs, ins.donate, ins))
        elif isinstance(ins, Transfer):
            src_here, dst_here = ins.src_rank in local, ins.dst_rank in local
            if src_here and dst_here:  # a run of consecutive local transfers: one call
                batch = [ins]
                while (
                    idx + len(batch) < len(instrs)
                    and isinstance(instrs[idx + len(batch)], Transfer)
                    and instrs[idx + len(batch)].src_rank in local
                    and instrs[idx + len(batch)].dst_rank in local
                ):
                    batch.append(instrs[idx + len(batch)])
                fast = all(
                    same_shard_layout(
                        slot_sharding[t.src], slot_sharding[t.dst], prog.slot_aval[t.src].shape
                    )
                    for t in batch
                )
                shardings = [slot_sharding[t.dst] for t in batch]
                copy = shard_copier(shardings) if fast else _device_put(shardings)
                op = Op(
                    _COPY, idx, (tuple(t.src for t in batch), tuple(t.dst for t in batch), copy)
                )
                ops.append(op)
                current = op
                idx += len(batch)
                continue
            if (src_here or dst_here) and idx in cross:  # the later ones go with the first
                op = Op(_CROSS, idx, cross[idx])
        elif isinstance(ins, Fill):
            if ins.rank in local:  # a run of consecutive fills on one group: one call
                batch = [ins]
                while (
                    idx + len(batch) < len(instrs)
                    and isinstance(instrs[idx + len(batch)], Fill)
                    and instrs[idx + len(batch)].rank == ins.rank
                ):
                    batch.append(instrs[idx + len(batch)])
                program = fills.program(batch, [slot_sharding[f.slot] for f in batch])
                op = Op(_FILL, idx, (tuple(f.slot for f in batch), program))
                ops.append(op)
                current = op
                idx += len(batch)
                continue
        elif isinstance(ins, Delete):
            if ins.rank in local:
                if current is None:
                    current = Op(_RELEASE, idx, ())
                    ops.append(current)
                if ins.slot in caller_donated:
                    current.kill += (ins.slot,)
                else:
                    current.drop += (ins.slot,)
                current.deletes += ((idx, ins.slot),)
            idx += 1
            continue
        if op is not None:
            ops.append(op)
        current = op
        idx += 1
    constants = {
        s: jax.device_put(v, slot_sharding[s])
        for s, v in prog.constants.items()
        if prog.slot_rank[s] in local
    }
    return Walk(
        prog,
        executables,
        ops,
        constants,
        slot_sharding,
        local,
        tuple(sorted(input_slots)),
        memory.device_bytes(prog, slot_sharding),
        mpmd_axis,
        cross,
    )


def execute(walk: Walk, inputs: dict, *, record_times=False, watchdog=None, probe=None):
    """Runs one step. `inputs` maps input slots to arrays already on their groups. Returns
    (per step output: {group: array}, measured task times or None).

    Multi-controller: only this process's groups run here; a transfer between a local and a
    remote group is a collective both processes issue in program order. A `watchdog` (several
    processes, `pipeline_hang_timeout_s`) is told each op as it is dispatched and is handed
    every cross-process transfer's result. `probe` (a `DeviceBytes`) measures device bytes."""
    prog, executables = walk.prog, walk.executables
    regs: list = [None] * len(prog.slot_rank)
    for s, v in inputs.items():
        regs[s] = v
    for s, v in walk.constants.items():
        regs[s] = v
    probes = [p for p in (probe, _SCAN.get()) if p is not None]
    for p in probes:
        p.begin(walk, inputs)
    events = [] if record_times else None
    if watchdog is not None:
        watchdog.start()
    for op in walk.ops:
        kind = op.kind
        if watchdog is not None:
            watchdog.enter(op.index)
        if kind == _RUN:
            ins, outs, donate, run = op.args
            exe = executables[op.index]
            if record_times:
                t0 = time.perf_counter()
                res = exe(*[regs[s] for s in ins])
                jax.block_until_ready(res)
                events.append((run.code.rank, run.name, run.code, t0, time.perf_counter()))
            else:
                res = exe(*[regs[s] for s in ins])
            for s, v in zip(outs, res):
                regs[s] = v
            del res  # the runtime's registers hold the only references
            for p in probes:
                p.made(outs, regs)
                if donate:
                    p.consumed([ins[d] for d in donate], regs)
        elif kind == _COPY:
            srcs, dsts, copy = op.args
            values = [regs[s] for s in srcs]
            moved = copy(values)
            del values
            for s, v in zip(dsts, moved):
                regs[s] = v
            del moved
            for p in probes:
                p.made(dsts, regs)
        elif kind == _CROSS:  # one batch of transfers to or from another process
            transfers, batch = op.args
            received, issued = batch([regs[t.src] for t in transfers] if batch.sending else None)
            if received is not None:
                for t, v in zip(transfers, received):
                    regs[t.dst] = v
            del received
            if watchdog is not None:
                watchdog.watch(op.index, issued)
            del issued
            for p in probes:
                p.made([t.dst for t in transfers], regs)
        elif kind == _FILL:  # fresh accumulators, made on the device
            slots, program = op.args
            for s, v in zip(slots, program()):
                regs[s] = v
            for p in probes:
                p.made(slots, regs)
        if probes:
            if kind != _RELEASE:
                for p in probes:
                    p.record(op.index)
            if kind == _COPY or kind == _FILL:  # a run is done once its one call returns
                for i in range(1, len(op.args[0])):
                    for p in probes:
                        p.record(op.index + i)
            for idx, s in op.deletes:
                value = regs[s]
                regs[s] = None
                if s in op.kill and value is not None and not value.is_deleted():
                    value.delete()
                for p in probes:
                    p.released(s, value)
                del value
                for p in probes:
                    p.record(idx)
            continue
        for s in op.kill:
            value = regs[s]
            if value is not None and not value.is_deleted():
                value.delete()
            regs[s] = None
        for s in op.drop:
            regs[s] = None
    if watchdog is not None:
        watchdog.leave()
    for p in probes:
        p.end(len(prog.instrs))
    outputs = [{r: regs[s] for r, s in slots.items()} for slots in prog.outputs]
    return outputs, events


def _device_put(shardings):
    return lambda values: jax.device_put(values, shardings)


# ------------------------------------------------------------------------- device bytes


@dataclasses.dataclass
class DeviceBytes:
    """Bytes of the buffers alive per device after each instruction of one step: the step's
    inputs and every buffer it made; not the buffers alive before it that are not its inputs
    (the caller's other arrays, the program's constants). Tracked from the program's own
    allocation and free events (see the module docstring); `checked` holds, at the instruction
    where a device of this process peaks (logically), the same figure read off the device
    buffers alive then (each buffer once).

    `timeline[i]`: {device id: bytes} right after instruction i (devices holding nothing are
    left out)."""

    check: bool = True  # scan the live buffers once, at the logical peak
    timeline: list = dataclasses.field(default_factory=list)
    checked: dict = dataclasses.field(default_factory=dict)  # instruction -> {device: bytes}
    _live: dict = dataclasses.field(default_factory=dict, repr=False)
    _counted: dict = dataclasses.field(default_factory=dict, repr=False)  # slot -> pieces
    _check_at: frozenset = frozenset()
    _scan: _Scan | None = dataclasses.field(default=None, repr=False)
    _bytes: list = dataclasses.field(default_factory=list, repr=False)
    _prev: dict = dataclasses.field(default_factory=dict, repr=False)

    def peak(self, devices) -> int:
        """The largest bytes any of `devices` (ids) held after any instruction."""
        return max((after.get(d, 0) for after in self.timeline for d in devices), default=0)

    def mismatches(self) -> list:
        """(instruction, tracked, scanned) where the check disagrees with the tracked figure."""
        out = []
        for idx, scanned in self.checked.items():
            tracked = self.timeline[idx]
            devices = set(scanned) | set(tracked)
            if any(tracked.get(d, 0) != scanned.get(d, 0) for d in devices):
                out.append((idx, tracked, scanned))
        return out

    # probe interface (called by `execute`)

    def begin(self, walk: Walk, inputs: dict) -> None:
        self.timeline, self.checked, self._live, self._counted = [], {}, {}, {}
        self._bytes = walk.slot_device_bytes
        seen = set()
        for s, value in inputs.items():  # each input buffer once, as a scan would count it
            pieces = []
            for key, nbytes in _buffers(value):
                if key not in seen:
                    seen.add(key)
                    pieces.append((key[0], nbytes))
            self._add(s, tuple(pieces))
        self._prev = {d: b for d, b in self._live.items() if b}
        if self.check:
            self._check_at = frozenset((walk.device_peak_index(),))
            self._scan = _Scan()
            self._scan.begin(walk, inputs)

    def made(self, slots, regs) -> None:
        for s in slots:
            if regs[s] is not None:
                self._add(s, self._bytes[s])

    def consumed(self, slots, regs) -> None:
        for s in slots:
            value = regs[s]
            if value is not None and value.is_deleted():
                self._remove(s)

    def released(self, slot, value) -> None:
        self._remove(slot)

    def record(self, index: int) -> None:
        """After instruction `index` (instructions of other processes' groups in between change
        nothing here: they repeat the figure)."""
        while len(self.timeline) < index:
            self.timeline.append(self._prev)
        self._prev = {d: b for d, b in self._live.items() if b}
        self.timeline.append(self._prev)
        if index in self._check_at:
            self.checked[index] = self._scan.measure()

    def end(self, num_instructions: int) -> None:
        if len(self.timeline) < num_instructions:
            self.record(num_instructions - 1)
        self._scan = None  # lets go of the arrays it held

    def _add(self, slot, pieces) -> None:
        self._counted[slot] = pieces
        for d, b in pieces:
            self._live[d] = self._live.get(d, 0) + b

    def _remove(self, slot) -> None:
        for d, b in self._counted.pop(slot, ()):
            self._live[d] -= b


class _Scan:
    """The bytes of the buffers alive per device, read off `jax.live_arrays()` (each buffer
    once): everything but what was alive before the step and is not one of its inputs."""

    def begin(self, walk: Walk, inputs: dict) -> None:
        taken = {key for x in inputs.values() for key, _ in _buffers(x)}
        # hold the arrays alive before the step, so no new buffer can reuse their addresses
        self._before = {key: a for a in jax.live_arrays() for key, _ in _buffers(a)}
        for key in taken:
            self._before.pop(key, None)

    def measure(self) -> dict:
        per_device: dict = {}
        seen = set(self._before)
        for a in jax.live_arrays():
            for key, nbytes in _buffers(a):
                if key not in seen:
                    seen.add(key)
                    per_device[key[0]] = per_device.get(key[0], 0) + nbytes
        return per_device


@dataclasses.dataclass
class ScannedDeviceBytes:
    """The former measurement: a scan of every live array after each instruction (one list of
    {device id: bytes} per step run inside `scanning_device_bytes()`). O(instructions x live
    arrays): for tests and debugging only."""

    steps: list = dataclasses.field(default_factory=list)

    def begin(self, walk: Walk, inputs: dict) -> None:
        self._scan = _Scan()
        self._scan.begin(walk, inputs)
        self.steps.append([])

    def made(self, slots, regs) -> None:
        pass

    def consumed(self, slots, regs) -> None:
        pass

    def released(self, slot, value) -> None:
        pass

    def record(self, index: int) -> None:
        steps = self.steps[-1]
        while len(steps) < index:  # instructions of other processes' groups change nothing here
            steps.append(steps[-1] if steps else self._scan.measure())
        steps.append(self._scan.measure())

    def end(self, num_instructions: int) -> None:
        if len(self.steps[-1]) < num_instructions:
            self.record(num_instructions - 1)
        self._scan = None


def _buffers(a):
    """((device id, buffer address), bytes) of each of a live array's device buffers."""
    if a.is_deleted():
        return []
    out = []
    for shard in a.addressable_shards:
        buf = shard.data
        out.append(((shard.device.id, buf.unsafe_buffer_pointer()), buf.nbytes))
    return out


_SCAN: contextvars.ContextVar[ScannedDeviceBytes | None] = contextvars.ContextVar(
    "jaxpp_scan_probe", default=None
)


@contextlib.contextmanager
def scanning_device_bytes():
    """Inside this context every step also scans the live device buffers after each
    instruction (waits for every task; slow: for tests and debugging). Yields the
    `ScannedDeviceBytes` that collects them."""
    probe = ScannedDeviceBytes()
    token = _SCAN.set(probe)
    try:
        yield probe
    finally:
        _SCAN.reset(token)
