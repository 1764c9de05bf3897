"""Static memory accounting of a `Program`: logical bytes alive per group, instruction by
instruction, computed from slot shapes without running anything.

The runtime's step-by-step books and the planner both follow the same rules:
- a step input is alive from the start (on every group that receives it);
- a `Run` allocates its outputs; inputs it donates are reused for outputs, so they stop counting
  when the task runs (their later `Delete(donated=True)` only closes the books);
- a `Transfer` allocates the copy on the receiving group, a `Fill` its buffer;
- a `Delete` frees the slot.
Slot kinds ("activation", "acc", "input", ...) are summed separately as well, so a caller can ask
for the peak of forward activations or of gradient accumulators alone. With `temp_bytes` (per
instruction index, e.g. from each executable's `memory_analysis()`), the peak also includes the
scratch space of the task running at that instruction.

Bytes are what the caller says a slot costs: whole arrays (`slot_bytes`) for the logical view of
a group, or one device's shard (`shard_bytes`) for the per-device view the planner needs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpp_integration.program import Delete, Fill, Program, Run, Transfer


@dataclasses.dataclass(frozen=True)
class MemoryPeaks:
    """Peaks per group (tuples indexed by rank) over one step."""

    peak_bytes: tuple  # all live values (+ the running task's temporaries when given)
    peak_by_kind: dict  # slot kind -> tuple of peaks per rank (each kind's own peak)
    timeline: tuple  # per instruction: tuple of live bytes per rank (without temporaries)


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


def replay(prog: Program, nbytes: list[int], temp_bytes: dict | None = None) -> MemoryPeaks:
    """Walks `prog` once; `nbytes[s]` is what slot s costs, `temp_bytes[i]` the scratch space
    of the task at instruction i."""
    n = prog.mpmd_dim
    kinds = sorted(set(prog.slot_kind))
    live = [0] * n
    by_kind = {k: [0] * n for k in kinds}
    peak = [0] * n
    peak_kind = {k: [0] * n for k in kinds}
    timeline = []

    def add(slot, rank, sign):
        live[rank] += sign * nbytes[slot]
        by_kind[prog.slot_kind[slot]][rank] += sign * nbytes[slot]

    for slots in prog.inputs:
        for r, s in slots.items():
            add(s, r, +1)
    for s in prog.constants:
        add(s, prog.slot_rank[s], +1)
    donated_early: set = set()
    for idx, ins in enumerate(prog.instrs):
        extra = [0] * n
        if isinstance(ins, Run):
            for s in ins.outs:
                add(s, prog.slot_rank[s], +1)
            for pos in ins.donate:
                s = ins.ins[pos]
                add(s, prog.slot_rank[s], -1)
                donated_early.add(s)
            if temp_bytes:
                extra[ins.code.rank] = temp_bytes.get(idx, 0)
        elif isinstance(ins, Transfer):
            add(ins.dst, ins.dst_rank, +1)
        elif isinstance(ins, Fill):
            add(ins.slot, ins.rank, +1)
        elif isinstance(ins, Delete) and ins.slot not in donated_early:
            add(ins.slot, ins.rank, -1)
        for r in range(n):
            peak[r] = max(peak[r], live[r] + extra[r])
            for k in kinds:
                peak_kind[k][r] = max(peak_kind[k][r], by_kind[k][r])
        timeline.append(tuple(live))
    return MemoryPeaks(
        peak_bytes=tuple(peak),
        peak_by_kind={k: tuple(v) for k, v in peak_kind.items()},
        timeline=tuple(timeline),
    )
