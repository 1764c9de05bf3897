"""The engine's report of a compiled step: what each task instance is, where it runs, what it
costs, and the memory events of the whole step (`compiled.report()`).

The planner (`MaxText.planning.cost_model`), the trainer's memory log and measurement, and the
benchmarks read a compiled step through this report instead of walking the program's
instructions. Everything in it is known once the step is compiled; nothing runs.

- `tasks`: one `TaskReport` per task instance, in dispatch order: instance and program names,
  kind (`before` | `loop` | `after`), phase and stage (loop tasks), group, microbatch, the FLOPs
  and bytes XLA's cost analysis gives per device, the matmul FLOPs counted on the task's own
  equations (`matmul_flops`: a scan's body once per trip, which XLA counts once), XLA's memory
  analysis per device (arguments, outputs, aliased, temporaries) and the bytes the task frees by
  donating its inputs.
- `transfers`: one `TransferReport` per value copied between groups (bytes, groups, and whether
  a loop task made it: the activations and cotangents crossing stage boundaries).
- `inputs`: per flat step input, the groups that receive it and the bytes it takes there.
- `values`: every value (slot) of the program: its group, kind, shape and dtype, sharding and
  bytes; the `reads`/`writes`/`value` fields above are indices into it.
- `events`: the program's allocation and free events (`MemoryEvent`, the rules of
  `tools.memory`), from which `memory()` replays the bytes alive per group after every
  instruction, whole arrays or one device's shard, optionally with each task's temporaries.

`index` fields are positions in the program's instruction list: `compiled.executables[index]` is
a task's executable, and `memory().timeline[index]` the bytes alive right after it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpp_integration.compiler.program import Delete, Fill, Program, Run, Transfer
from jaxpp_integration.schedules import Phase
from jaxpp_integration.tools import memory


@dataclasses.dataclass(frozen=True)
class XlaCosts:
    """One compiled program's cost and memory analysis, per device."""

    flops: float  # XLA's count (a loop body once)
    bytes_accessed: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int


@dataclasses.dataclass(frozen=True)
class TaskReport:
    """One task instance of the step, in dispatch order."""

    index: int  # position in the program's instructions
    name: str  # the instance: "fwd_1__3", "after_loop_0_1", "reduce_0"
    program: str  # the task program it runs ("fwd_1"); one executable per group and program
    kind: str  # "before" | "loop" | "after"
    phase: Phase | None  # loop tasks: FWD, BWD, BWD_I or BWD_W
    stage: int | None  # loop tasks
    group: int
    microbatch: int | None  # loop tasks
    devices: int  # devices of the group, which all run the task (SPMD)
    # XLA's analyses: zeros for a task of another process's group (compiled there only)
    flops: float  # per device, XLA's cost analysis
    bytes_accessed: float  # per device, XLA's cost analysis
    matmul_flops: float  # whole group: 2*M*N*K of its dot_generals, scan bodies per trip
    argument_bytes: int  # per device, XLA's memory analysis
    output_bytes: int
    alias_bytes: int
    temp_bytes: int  # XLA's scratch while it runs (not in the live timeline)
    donated_bytes: int  # per device: inputs it consumes in place (freed by the task)
    reads: tuple  # values (slots) it reads
    writes: tuple  # values (slots) it makes
    donates: tuple  # the values among `reads` it consumes


@dataclasses.dataclass(frozen=True)
class TransferReport:
    index: int
    src_group: int
    dst_group: int
    source: int  # the value (slot) copied
    value: int  # the value made on the receiving group
    bytes: int  # whole array
    device_bytes: int  # one device's shard
    from_loop: bool  # made by a loop task: an activation or cotangent between stages


@dataclasses.dataclass(frozen=True)
class InputReport:
    """One flat step input: the groups receiving it, and its bytes there."""

    position: int
    groups: tuple  # groups holding it
    values: dict  # group -> the value (slot) holding it there
    bytes: int  # whole array
    device_bytes: dict  # group -> one device's shard


@dataclasses.dataclass(frozen=True)
class ValueReport:
    """One value (slot) of the program: where it lives, what it is, its layout."""

    group: int
    kind: str  # "input" | "const" | "activation" | "acc" | "value"
    aval: Any  # shape and dtype
    sharding: Any  # on the group's devices
    bytes: int  # whole array
    device_bytes: int  # one device's shard


@dataclasses.dataclass(frozen=True)
class MemoryEvent:
    index: int  # instruction (memory.BEFORE_STEP: a step input, alive from the start)
    group: int
    value: int  # slot
    kind: str  # "input" | "activation" | "acc" | "value" | "const"
    change: int  # memory.ALLOC (+1) or memory.FREE (-1)
    bytes: int  # whole array
    device_bytes: int  # one device's shard


@dataclasses.dataclass(frozen=True)
class EngineReport:
    """A compiled step, described (see the module docstring)."""

    num_groups: int
    group_devices: tuple  # per group: the ids of its devices
    num_microbatches: int
    schedule: Any
    num_instructions: int
    counts: dict  # instructions by kind: run, transfer, fill, delete
    tasks: tuple
    transfers: tuple
    inputs: tuple
    values: tuple  # ValueReport per slot (`reads`, `writes`, `value` fields index it)
    events: tuple
    _program: Program = dataclasses.field(repr=False, compare=False)
    _shard_bytes: list = dataclasses.field(repr=False, compare=False)

    def memory(
        self, *, per_device: bool = False, temps: bool = False, input_groups=None
    ) -> memory.MemoryReport:
        """Bytes alive per group after every instruction: whole arrays (`per_device=False`, the
        runtime's `last_memory`) or one device's shard (the planner's); `temps=True` adds the
        running task's XLA temporaries to `peak_with_temp_bytes`; `input_groups`: the groups
        whose step inputs are counted (default all; a process counts its own)."""
        prog = self._program
        nbytes = (
            self._shard_bytes if per_device else [memory.slot_nbytes(a) for a in prog.slot_aval]
        )
        slots = None
        if input_groups is not None:
            slots = [s for d in prog.inputs for r, s in d.items() if r in input_groups]
        temp = {t.index: t.temp_bytes for t in self.tasks} if temps else None
        return memory.replay(prog, nbytes, input_slots=slots, temp_bytes=temp)

    def tasks_of(self, group: int) -> list:
        return [t for t in self.tasks if t.group == group]


def build_report(prog: Program, executables: dict, slot_sharding: dict, mesh, schedule):
    """The report of a compiled program (`compiled.report()` calls this once and keeps it)."""
    nbytes = [memory.slot_nbytes(a) for a in prog.slot_aval]
    shard = memory.shard_bytes(prog, slot_sharding)
    costs: dict = {}  # id(executable) -> XlaCosts
    flops_of: dict = {}  # id(TaskCode) -> matmul FLOPs
    producer = {s: ins for ins in prog.instrs if isinstance(ins, Run) for s in ins.outs}
    tasks, transfers, counts = [], [], {"run": 0, "transfer": 0, "fill": 0, "delete": 0}
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Run):
            counts["run"] += 1
            code = ins.code
            exe = executables.get(idx)  # None: another process's group compiled it
            if id(exe) not in costs:
                costs[id(exe)] = xla_costs(exe) if exe is not None else _NOT_HERE
            if id(code) not in flops_of:
                flops_of[id(code)] = matmul_flops(code.eqns)
            c = costs[id(exe)]
            tasks.append(
                TaskReport(
                    index=idx,
                    name=ins.name,
                    program=code.name,
                    kind=code.kind,
                    phase=code.phase,
                    stage=code.stage,
                    group=code.rank,
                    microbatch=ins.microbatch,
                    devices=len(mesh.devices_of(code.rank)),
                    flops=c.flops,
                    bytes_accessed=c.bytes_accessed,
                    matmul_flops=flops_of[id(code)],
                    argument_bytes=c.argument_bytes,
                    output_bytes=c.output_bytes,
                    alias_bytes=c.alias_bytes,
                    temp_bytes=c.temp_bytes,
                    donated_bytes=sum(shard[ins.ins[p]] for p in ins.donate),
                    reads=tuple(ins.ins),
                    writes=tuple(ins.outs),
                    donates=tuple(ins.ins[p] for p in ins.donate),
                )
            )
        elif isinstance(ins, Transfer):
            counts["transfer"] += 1
            made = producer.get(ins.src)
            transfers.append(
                TransferReport(
                    index=idx,
                    src_group=ins.src_rank,
                    dst_group=ins.dst_rank,
                    source=ins.src,
                    value=ins.dst,
                    bytes=nbytes[ins.dst],
                    device_bytes=shard[ins.dst],
                    from_loop=made is not None and made.code.kind == "loop",
                )
            )
        elif isinstance(ins, Fill):
            counts["fill"] += 1
        elif isinstance(ins, Delete):
            counts["delete"] += 1
    inputs = tuple(
        InputReport(
            position=i,
            groups=tuple(sorted(slots)),
            values=dict(slots),
            bytes=nbytes[next(iter(slots.values()))] if slots else 0,
            device_bytes={r: shard[s] for r, s in slots.items()},
        )
        for i, slots in enumerate(prog.inputs)
    )
    evs = tuple(
        MemoryEvent(idx, prog.slot_rank[s], s, prog.slot_kind[s], change, nbytes[s], shard[s])
        for idx, s, change in memory.events(prog)
    )
    return EngineReport(
        num_groups=prog.mpmd_dim,
        group_devices=tuple(tuple(d.id for d in mesh.devices_of(r)) for r in range(prog.mpmd_dim)),
        num_microbatches=prog.num_microbatches,
        schedule=schedule,
        num_instructions=len(prog.instrs),
        counts=counts,
        tasks=tuple(tasks),
        transfers=tuple(transfers),
        inputs=inputs,
        values=tuple(
            ValueReport(
                prog.slot_rank[s],
                prog.slot_kind[s],
                prog.slot_aval[s],
                slot_sharding.get(s),
                nbytes[s],
                shard[s],
            )
            for s in range(len(prog.slot_aval))
        ),
        events=evs,
        _program=prog,
        _shard_bytes=shard,
    )


_NOT_HERE = XlaCosts(0.0, 0.0, 0, 0, 0, 0)


def xla_costs(executable) -> XlaCosts:
    """XLA's cost and memory analysis of one compiled program, per device (zeros where the
    backend gives none)."""
    ca = executable.cost_analysis()
    ca = (ca[0] if isinstance(ca, list) else ca) or {}
    m = executable.memory_analysis()
    size = lambda name: int(getattr(m, f"{name}_size_in_bytes", 0) or 0)  # noqa: E731
    return XlaCosts(
        flops=float(ca.get("flops", 0.0)),
        bytes_accessed=float(ca.get("bytes accessed", 0.0)),
        argument_bytes=size("argument"),
        output_bytes=size("output"),
        alias_bytes=size("alias"),
        temp_bytes=size("temp"),
    )


def matmul_flops(jaxpr_or_eqns) -> float:
    """2·M·N·K summed over every `dot_general` of a jaxpr (or a list of its equations) and of the
    jaxprs inside them, a scan's body once per iteration and a `shard_map`'s body once per device
    it runs on (its shapes are one device's). Counted on the program itself, so it includes
    rematerialised work; XLA's `cost_analysis()` counts a loop's body only once, which
    undercounts a scanned stage by its layer count. Data-dependent work (`ragged_dot`, whose
    rows depend on the routing) is not counted: its caller knows what to expect."""
    from jax.extend.core import jaxprs_in_params

    eqns = getattr(jaxpr_or_eqns, "eqns", jaxpr_or_eqns)
    total = 0.0
    for eqn in eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            k = 1
            for d in contract:
                k *= lhs.shape[d]
            out = 1
            for d in eqn.outvars[0].aval.shape:
                out *= d
            total += 2.0 * out * k
        trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        if eqn.primitive.name == "shard_map":
            trips = _manual_devices(eqn.params)
        for sub in jaxprs_in_params(eqn.params):
            total += trips * matmul_flops(sub)
    return total


def _manual_devices(params) -> int:
    """Devices a `shard_map` body runs on: the product of its manual axes' sizes."""
    shape = dict(params["mesh"].shape)
    axes = params.get("manual_axes") or params.get("newly_manual_axes") or shape
    out = 1
    for a in axes:
        out *= shape[a]
    return out
