"""Logical memory of a `Program`: its allocation and free events, and the bytes alive per group
after every instruction, computed from slot shapes in program order without reading devices.

One set of rules (`events`) serves the runtime's `last_memory` (whole arrays per group), the
planner (one device's shard per group, plus each task's XLA temporaries, through
`tools.report`) and the runtime's device-bytes measurement (every device's shard, tracked per
event instead of scanning live arrays):
- a step input is alive from the start on the group that receives it (constants, a few index
  scalars put on the devices once, are not counted);
- a `Run` allocates its outputs; an input it donates is freed by that task (XLA writes an output
  into it), so its later `Delete(donated=True)` only closes the books;
- a `Transfer` allocates the copy on the receiving group, a `Fill` its buffer; a `Delete` frees.
Forward activations (slot kind "activation": those a group keeps for its backward, sends, or
received from the previous stage) and gradient accumulators ("acc") are also followed on their
own. Not a device reading: XLA's temporaries inside a task are not in the timeline, and
asynchronous dispatch may free a buffer later than its Delete (the device-bytes measurement of
`runtime.executor` counts a buffer as gone when JAX marks it deleted, as `jax.live_arrays()`
does); tests/test_engine_memory.py checks the figures against the device buffers of real steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from jaxpp_integration.compiler.program import Delete, Fill, Program, Run, Transfer

ALLOC, FREE = +1, -1
BEFORE_STEP = -1  # the instruction index of the step inputs' allocation events


@dataclasses.dataclass
class MemoryReport:
    """Logical bytes per group (tuples indexed by rank) over one step."""

    timeline: list  # per instruction: tuple of live bytes per rank
    activation_timeline: list  # per instruction: live forward-activation bytes per rank
    peak_bytes: tuple
    peak_activation_bytes: tuple
    peak_by_kind: dict = dataclasses.field(default_factory=dict)  # slot kind -> peaks per rank
    peak_with_temp_bytes: tuple = ()  # live bytes + the running task's temporaries, if given
    peak_index: tuple = ()  # per rank: the first instruction where `peak_bytes` is reached


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


def device_bytes(prog: Program, slot_sharding: dict) -> list[tuple]:
    """Per slot: ((device id, bytes of that device's shard), ...) over every device holding a
    piece of it (uneven shardings included: each device's own slice)."""
    out = []
    itemsize = [np.dtype(a.dtype).itemsize for a in prog.slot_aval]
    for s, aval in enumerate(prog.slot_aval):
        sh = slot_sharding.get(s)
        if sh is None:
            out.append(())
            continue
        shape = tuple(aval.shape)
        pieces = []
        for device, index in sh.devices_indices_map(shape).items():
            n = 1
            for dim, sl in zip(shape, index):
                n *= len(range(*sl.indices(dim)))
            pieces.append((device.id, n * itemsize[s]))
        out.append(tuple(sorted(pieces)))
    return out


def events(prog: Program, input_slots: Iterable[int] | None = None) -> list[tuple[int, int, int]]:
    """The program's allocation and free events in order: (instruction index, slot, ALLOC or
    FREE). Step inputs (`input_slots`, default every group's) are allocated at `BEFORE_STEP`."""
    if input_slots is None:
        input_slots = [s for slots in prog.inputs for s in slots.values()]
    out = [(BEFORE_STEP, s, ALLOC) for s in input_slots]
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Run):
            out.extend((idx, s, ALLOC) for s in ins.outs)
            out.extend((idx, ins.ins[pos], FREE) for pos in ins.donate)
        elif isinstance(ins, Transfer):
            out.append((idx, ins.dst, ALLOC))
        elif isinstance(ins, Fill):
            out.append((idx, ins.slot, ALLOC))
        elif isinstance(ins, Delete) and not ins.donated:
            out.append((idx, ins.slot, FREE))
    return out


def replay(
    prog: Program,
    nbytes: list[int],
    input_slots: Iterable[int] | None = None,
    temp_bytes: dict | None = None,
) -> MemoryReport:
    """Walks the program's `events` once. `nbytes[s]` is what slot s costs; `input_slots` the
    step inputs held (default: every group's); `temp_bytes[i]` the scratch space of the task at
    instruction i."""
    n = prog.mpmd_dim
    kinds = sorted(set(prog.slot_kind))
    live = [0] * n
    by_kind = {k: [0] * n for k in kinds}
    peak_kind = {k: [0] * n for k in kinds}
    peak_temp = [0] * n
    timeline, act_timeline = [], []
    temp_bytes = temp_bytes or {}
    todo = events(prog, input_slots)
    pos = 0
    while pos < len(todo) and todo[pos][0] == BEFORE_STEP:
        _, s, sign = todo[pos]
        live[prog.slot_rank[s]] += sign * nbytes[s]
        by_kind[prog.slot_kind[s]][prog.slot_rank[s]] += sign * nbytes[s]
        pos += 1
    zeros = (0,) * n
    for idx, ins in enumerate(prog.instrs):
        while pos < len(todo) and todo[pos][0] == idx:
            _, s, sign = todo[pos]
            r = prog.slot_rank[s]
            live[r] += sign * nbytes[s]
            by_kind[prog.slot_kind[s]][r] += sign * nbytes[s]
            pos += 1
        running = ins.code.rank if isinstance(ins, Run) else None
        for r in range(n):
            extra = temp_bytes.get(idx, 0) if r == running else 0
            peak_temp[r] = max(peak_temp[r], live[r] + extra)
            for k in kinds:
                peak_kind[k][r] = max(peak_kind[k][r], by_kind[k][r])
        timeline.append(tuple(live))
        act_timeline.append(tuple(by_kind["activation"]) if "activation" in by_kind else zeros)
    peaks = tuple(max((t[r] for t in timeline), default=0) for r in range(n))
    return MemoryReport(
        timeline=timeline,
        activation_timeline=act_timeline,
        peak_bytes=peaks,
        peak_activation_bytes=tuple(max((t[r] for t in act_timeline), default=0) for r in range(n)),
        peak_by_kind={k: tuple(v) for k, v in peak_kind.items()},
        peak_with_temp_bytes=tuple(peak_temp),
        peak_index=tuple(
            next((i for i, t in enumerate(timeline) if t[r] == peaks[r]), 0) for r in range(n)
        ),
    )
