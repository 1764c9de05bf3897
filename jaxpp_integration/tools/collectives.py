"""Counting collectives per step from a compiled program (exact on any machine, no timing).

Every `Run` instruction's executable is compiled HLO after SPMD partitioning, so the collectives
XLA inserted inside a group (all-reduce over replicated axes, reduce-scatter / all-gather over
fsdp, ...) can be read off its text. Multiplying by the instances in the program (one `Run` per
task instance) gives launches and bytes per step; `Transfer` instructions between groups are
counted as "transfer" with the bytes of the value moved. Shared by the tests and
`benchmarks/collectives.py`.
"""

from __future__ import annotations

import re

import numpy as np

from jaxpp_integration.compiler.program import Run, Transfer

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
# `%name = <result type> kind(` or `kind-start(`; the result type may be a tuple
_OP = re.compile(r"=\s*(?P<type>.+?)\s+(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")


def _shape_bytes(dtype: str, dims: str) -> int:
    return (
        int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _DTYPE_BYTES[dtype]
    )


def hlo_collectives(hlo_text: str) -> dict:
    """{kind: (launches, bytes)} of one compiled program's HLO text (bytes of each result, per
    device; an async `-start` op counts once, its `-done` not at all)."""
    out: dict = {}
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        kind = m.group("kind")
        type_text = m.group("type")
        shapes = _SHAPE.findall(type_text)
        if m.group(0).rstrip("(").endswith("-start") and type_text.startswith("("):
            shapes = shapes[1:2]  # async starts return (operand, result, ...): the result
        size = sum(_shape_bytes(dtype, dims) for dtype, dims in shapes)
        n, b = out.get(kind, (0, 0))
        out[kind] = (n + 1, b + size)
    return out


def program_collectives(compiled) -> dict:
    """Per step of a `CompiledMpmdFunction`: {kind: {"launches", "bytes"}} summed over every task
    instance of every group, plus "transfer" for values moved between groups. Also
    "by_task": {task name: {kind: launches per instance}}."""
    prog = compiled.program
    per_exe: dict = {}
    totals = {k: {"launches": 0, "bytes": 0} for k in (*KINDS, "transfer")}
    by_task: dict = {}
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Transfer):
            aval = prog.slot_aval[ins.dst]
            totals["transfer"]["launches"] += 1
            totals["transfer"]["bytes"] += (
                int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
            )
        elif isinstance(ins, Run):
            exe = compiled.executables[idx]
            if id(exe) not in per_exe:
                per_exe[id(exe)] = hlo_collectives(exe.as_text())
            counts = per_exe[id(exe)]
            by_task[ins.code.name] = {k: n for k, (n, _) in counts.items()}
            for kind, (n, b) in counts.items():
                totals[kind]["launches"] += n
                totals[kind]["bytes"] += b
    totals["by_task"] = by_task
    return totals


def task_collectives(compiled, name_prefix: str, kind: str) -> int:
    """Launches of `kind` per step summed over task instances whose name starts with
    `name_prefix` (e.g. "bwd_", "reduce_")."""
    prog = compiled.program
    seen: dict = {}
    total = 0
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Run) and ins.code.name.startswith(name_prefix):
            exe = compiled.executables[idx]
            if id(exe) not in seen:
                seen[id(exe)] = hlo_collectives(exe.as_text()).get(kind, (0, 0))[0]
            total += seen[id(exe)]
    return total
