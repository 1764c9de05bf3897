"""Logical memory of a `Program`: bytes alive per group after every instruction, computed from
slot shapes in program order, without reading devices.

One set of rules serves the runtime's `last_memory` (whole arrays per group) and the planner
(`MaxText.plan`: one device's shard per group, plus each task's XLA temporaries):
- a step input is alive from the start on the group that receives it (constants, a few index
  scalars put on the devices once, are not counted);
- a `Run` allocates its outputs; an input it donates is freed by that task (XLA writes the output
  into it), so its later `Delete(donated=True)` only closes the books;
- a `Transfer` allocates the copy on the receiving group, a `Fill` its buffer; a `Delete` frees.
Forward activations (slot kind "activation": those a group keeps for its backward, sends, or
received from the previous stage) and gradient accumulators ("acc") are also followed on their
own. Not a device reading: XLA's temporaries inside a task are not in the timeline, and
asynchronous dispatch may free a buffer later than its Delete; `runtime.measuring_device_bytes()`
checks the figures against the device buffers of a real step (tests/test_engine_memory.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from jaxpp_integration.compiler.program import Delete, Fill, Program, Run, Transfer


@dataclasses.dataclass
class MemoryReport:
    """Logical bytes per group (tuples indexed by rank) over one step."""

    timeline: list  # per instruction: tuple of live bytes per rank
    activation_timeline: list  # per instruction: live forward-activation bytes per rank
    peak_bytes: tuple
    peak_activation_bytes: tuple
    peak_by_kind: dict = dataclasses.field(default_factory=dict)  # slot kind -> peaks per rank
    peak_with_temp_bytes: tuple = ()  # live bytes + the running task's temporaries, if given


def slot_nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def shard_bytes(prog: Program, slot_sharding: dict) -> list[int]:
    """Bytes of one device's shard of every slot (whole bytes when the slot is replicated)."""
    out = []
    for s, aval in enumerate(prog.slot_aval):
        sh = slot_sharding.get(s)
        shape = tuple(sh.shard_shape(tuple(aval.shape))) if sh is not None else aval.shape
        out.append(int(np.prod(shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize)
    return out


def replay(
    prog: Program,
    nbytes: list[int],
    input_slots: Iterable[int] | None = None,
    temp_bytes: dict | None = None,
) -> MemoryReport:
    """Walks `prog` once. `nbytes[s]` is what slot s costs; `input_slots` the step inputs held
    (default: every group's); `temp_bytes[i]` the scratch space of the task at instruction i."""
    n = prog.mpmd_dim
    kinds = sorted(set(prog.slot_kind))
    live = [0] * n
    by_kind = {k: [0] * n for k in kinds}
    peak_kind = {k: [0] * n for k in kinds}
    peak_temp = [0] * n
    timeline, act_timeline = [], []

    def add(slot, sign):
        r = prog.slot_rank[slot]
        live[r] += sign * nbytes[slot]
        by_kind[prog.slot_kind[slot]][r] += sign * nbytes[slot]

    if input_slots is None:
        input_slots = [s for slots in prog.inputs for s in slots.values()]
    for s in input_slots:
        add(s, +1)
    zeros = [0] * n
    for idx, ins in enumerate(prog.instrs):
        temp = 0
        if isinstance(ins, Run):
            for s in ins.outs:
                add(s, +1)
            for pos in ins.donate:
                add(ins.ins[pos], -1)
            temp = temp_bytes.get(idx, 0) if temp_bytes else 0
        elif isinstance(ins, Transfer):
            add(ins.dst, +1)
        elif isinstance(ins, Fill):
            add(ins.slot, +1)
        elif isinstance(ins, Delete) and not ins.donated:
            add(ins.slot, -1)
        for r in range(n):
            extra = temp if isinstance(ins, Run) and ins.code.rank == r else 0
            peak_temp[r] = max(peak_temp[r], live[r] + extra)
            for k in kinds:
                peak_kind[k][r] = max(peak_kind[k][r], by_kind[k][r])
        timeline.append(tuple(live))
        act_timeline.append(tuple(by_kind.get("activation", zeros)))
    return MemoryReport(
        timeline=timeline,
        activation_timeline=act_timeline,
        peak_bytes=tuple(max((t[r] for t in timeline), default=0) for r in range(n)),
        peak_activation_bytes=tuple(max((t[r] for t in act_timeline), default=0) for r in range(n)),
        peak_by_kind={k: tuple(v) for k, v in peak_kind.items()},
        peak_with_temp_bytes=tuple(peak_temp),
    )
