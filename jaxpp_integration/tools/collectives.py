"""Counting collectives per step from a compiled program (exact on any machine, no timing).

Every `Run` instruction's executable is compiled HLO after SPMD partitioning, so the collectives
XLA inserted inside a group (all-reduce over replicated axes, reduce-scatter / all-gather over
fsdp, ...) can be read off its text. A collective inside a `while` body runs once per trip: the
HLO module is read as a call graph (`while` bodies weighted by the trip count XLA records in
`known_trip_count`, other called computations once), so each op counts as many times as it
runs. Its `replica_groups` (explicit, iota or mesh-axes form) give the devices it spans, mapped
to the axes of the group's mesh that vary inside one replica group. Multiplying by the
instances in the program (one `Run` per task instance) gives launches and bytes per step;
`Transfer` instructions between groups are counted as "transfer" with the bytes of the value
moved. Shared by the tests and `benchmarks/collectives.py`.
"""

from __future__ import annotations

import dataclasses
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
_OP = re.compile(r"=\s*(?P<type>.+?)\s+(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
# a computation's header: `%name (params) -> type {` or `ENTRY %name ...`
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(
    r"\b(?P<key>body|condition|calls|to_apply|true_computation|false_computation)=%?(?P<name>[\w.\-]+)"
)
_BRANCHES = re.compile(r"\bbranch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
# substrings a line must hold for `_OP` / `_CALLEE` / `_BRANCHES` to match (cheap tests first)
_CALL_KEYS = ("body=", "condition=", "calls=", "to_apply=", "_computation=", "computations=")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of an HLO module: its kind, result bytes per device, how many times one
    run of the module launches it (the product of the trip counts of the loops around it), and
    the logical device ids of each replica group (None: every device in one group)."""

    kind: str
    bytes: int
    times: int
    groups: tuple | None


def _shape_bytes(dtype: str, dims: str) -> int:
    return (
        int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _DTYPE_BYTES[dtype]
    )


def _op_bytes(m) -> int:
    type_text = m.group("type")
    shapes = _SHAPE.findall(type_text)
    if m.group("start") and type_text.startswith("("):
        shapes = shapes[1:2]  # async starts return (operand, result, ...): the result
    return sum(_shape_bytes(dtype, dims) for dtype, dims in shapes)


def _computations(hlo_text: str):
    """({name: [instruction lines]}, name of the entry computation)."""
    comps: dict = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m:
                current = m.group("name")
                comps[current] = []
                if m.group("entry"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    if entry is None:  # a bare list of instructions (no module around them)
        comps = {"": hlo_text.splitlines()}
        entry = ""
    return comps, entry


def _callees(line: str) -> list:
    """(computation, runs per run of this instruction) for each computation `line` calls."""
    out = []
    trips = None
    if re.search(r"\swhile\(", line):
        m = _TRIP_COUNT.search(line)
        if m is None:
            raise ValueError(
                "a while loop without a known trip count: its collectives cannot be counted "
                f"per trip ({line.strip()[:160]}...)"
            )
        trips = int(m.group("n"))
    for m in _CALLEE.finditer(line):
        key = m.group("key")
        if key == "body":
            out.append((m.group("name"), trips))
        elif key == "condition":
            out.append((m.group("name"), trips + 1))
        else:
            out.append((m.group("name"), 1))
    m = _BRANCHES.search(line)
    if m:  # a conditional: each branch counted once (an upper bound; none of ours has one)
        out += [(n.strip().lstrip("%"), 1) for n in m.group("names").split(",") if n.strip()]
    return out


def collective_ops(hlo_text: str) -> list:
    """Every collective of one compiled program's HLO text as `CollectiveOp`s, a collective in a
    `while` body counted once per trip (an async `-start` op counts, its `-done` does not)."""
    comps, entry = _computations(hlo_text)
    memo: dict = {}

    def ops_of(name: str, depth: int = 0) -> list:
        if name in memo:
            return memo[name]
        if depth > 100:
            raise ValueError(f"HLO computations call each other too deeply at {name}")
        found = []
        for line in comps.get(name, ()):
            m = _OP.search(line) if any(k in line for k in KINDS) else None
            if m is not None:
                found.append(CollectiveOp(m.group("kind"), _op_bytes(m), 1, replica_groups(line)))
                continue
            if not any(k in line for k in _CALL_KEYS):
                continue
            for callee, times in _callees(line):
                found += [
                    dataclasses.replace(op, times=op.times * times)
                    for op in ops_of(callee, depth + 1)
                ]
        memo[name] = found
        return found

    return ops_of(entry)


def hlo_collectives(hlo_text: str) -> dict:
    """{kind: (launches, bytes)} of one run of a compiled program (bytes of each result, per
    device), a collective in a `while` body counted once per trip."""
    out: dict = {}
    for op in collective_ops(hlo_text):
        n, b = out.get(op.kind, (0, 0))
        out[op.kind] = (n + op.times, b + op.times * op.bytes)
    return out


# ------------------------------------------------------------------ replica groups


def _iota(dims: list, perm: list | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims)), dtype=np.int64).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def replica_groups(line: str) -> tuple | None:
    """The replica groups of one collective's HLO line as tuples of logical device ids, in any
    of XLA's three spellings: `{{0,1},{2,3}}`, iota `[2,2]<=[2,2]T(1,0)`, or mesh axes
    `mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}`. None when the op
    names no groups (one group of every device)."""
    m = re.search(r"replica_groups=(\{\{[^=]*?\}\}|\{\})", line)
    if m:
        text = m.group(1)
        if text == "{}":
            return None
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1]))
    m = re.search(
        r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?",
        line,
    )
    if m:
        ids = _iota(_ints(m.group("dims")), _ints(m.group("perm")) if m.group("perm") else None)
        return tuple(tuple(int(x) for x in g) for g in ids.reshape(_ints(m.group("shape"))))
    m = re.search(
        r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
        r"(?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?\s*\{(?P<group>[^}]*)\}",
        line,
    )
    if m:
        return _mesh_groups(m.group("axes"), m.group("ids"), m.group("group"))
    if "replica_groups=" in line:
        raise ValueError(f"unknown replica_groups spelling in: {line.strip()[:200]}")
    return None


def _mesh_groups(axes_text: str, ids_text: str | None, group_text: str) -> tuple:
    names, sizes = [], []
    for name, size in re.findall(r"'([^']+)'=(\d+)", axes_text):
        names.append(name)
        sizes.append(int(size))
    total = int(np.prod(sizes))
    if ids_text:
        m = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", ids_text)
        if m:
            ids = _iota(_ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None).reshape(-1)
        else:
            ids = np.asarray(_ints(ids_text.strip("[]() ")), np.int64)
    else:
        ids = np.arange(total, dtype=np.int64)
    # axes, with sub-axes `'name':(pre)size` split out of their axis: [pre, size, rest]
    shape, labels = [], []
    refs = [r.strip() for r in group_text.split(",") if r.strip()]
    subs = {}
    for ref in refs:
        m = re.fullmatch(r"'([^']+)'(?::\((\d+)\)(\d+))?", ref)
        if m is None:
            raise ValueError(f"unknown replica group axis {ref!r} in mesh[{axes_text}]")
        if m.group(2):
            subs[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    for name, size in zip(names, sizes):
        if name in subs:
            pre, sub = subs[name]
            shape += [pre, sub, size // (pre * sub)]
            labels += [None, f"'{name}':({pre}){sub}", None]
        else:
            shape.append(size)
            labels.append(f"'{name}'")
    grouped = [labels.index(r) for r in refs]
    others = [i for i in range(len(shape)) if i not in grouped]
    arr = ids.reshape(shape).transpose(others + grouped)
    size = int(np.prod([shape[i] for i in grouped]))
    return tuple(tuple(int(x) for x in g) for g in arr.reshape(-1, size))


def group_axes(groups: tuple | None, mesh) -> tuple:
    """The axes of `mesh` (a group's sub-mesh; logical id i = the i-th device of
    `mesh.devices.flat`) along which the devices of one replica group differ, in mesh order."""
    shape = tuple(mesh.devices.shape)
    if groups is None:
        return tuple(a for a, n in zip(mesh.axis_names, shape) if n > 1)
    varying = set()
    for g in groups:
        coords = np.array([np.unravel_index(i, shape) for i in g])
        varying |= {k for k in range(len(shape)) if len(set(coords[:, k])) > 1}
    return tuple(a for k, a in enumerate(mesh.axis_names) if k in varying)


# ------------------------------------------------------------------ programs


def axes_key(axes: tuple) -> str:
    """'data', 'data+fsdp', ... ('' for a collective within one device)."""
    return "+".join(axes)


def program_collectives(compiled, where=None, cache: dict | None = None) -> dict:
    """Per step of a `CompiledMpmdFunction`: {kind: {"launches", "bytes"}} summed over every task
    instance of every group, plus "transfer" for values moved between groups; "by_axis":
    {kind: {axes: {"launches", "bytes"}}} with the mesh axes each collective spans
    (`axes_key`); "by_group": {group: {kind: {"launches", "bytes"}}} of the collectives (not
    transfers) each group's devices run; "by_task": {task name: {kind: launches per instance}}.
    `where(task code)` keeps only some tasks (e.g. the loop's and the `reduce_r` ones).
    `cache`: a dict shared by calls on the same compiled step (each program is read once)."""
    prog = compiled.program
    per_exe: dict = {} if cache is None else cache
    totals = {k: {"launches": 0, "bytes": 0} for k in (*KINDS, "transfer")}
    by_axis: dict = {}
    by_group: dict = {}
    by_task: dict = {}
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Transfer) and where is None:
            aval = prog.slot_aval[ins.dst]
            totals["transfer"]["launches"] += 1
            totals["transfer"]["bytes"] += (
                int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
            )
        elif isinstance(ins, Run) and (where is None or where(ins.code)):
            ops = _task_ops(compiled, idx, per_exe)
            counts: dict = {}
            for op, axes in ops:
                counts[op.kind] = counts.get(op.kind, 0) + op.times
                group = by_group.setdefault(ins.code.rank, {}).setdefault(
                    op.kind, {"launches": 0, "bytes": 0}
                )
                axis = by_axis.setdefault(op.kind, {}).setdefault(
                    axes_key(axes), {"launches": 0, "bytes": 0}
                )
                for entry in (totals[op.kind], axis, group):
                    entry["launches"] += op.times
                    entry["bytes"] += op.times * op.bytes
            by_task[ins.code.name] = counts
    totals["by_axis"] = by_axis
    totals["by_group"] = by_group
    totals["by_task"] = by_task
    return totals


def _task_ops(compiled, idx: int, cache: dict) -> list:
    """[(CollectiveOp, axes)] of instruction `idx`'s executable. Each module's text is read
    once, and each distinct text parsed once (a program loaded on several groups has one text:
    replica groups name logical devices); the axes are its group's."""
    exe = compiled.executables[idx]
    ins = compiled.program.instrs[idx]
    key = (id(exe), ins.code.rank)
    if key not in cache:
        mesh = compiled.mpmd_mesh.unstack[ins.code.rank]
        modules = getattr(exe, "executables", [exe])  # a task run as pieces: each its own module
        texts = cache.setdefault("texts", {})
        parsed = cache.setdefault("parsed", {})
        found = []
        for module in modules:
            if id(module) not in texts:
                texts[id(module)] = (module, module.as_text())  # the module kept: its id stays its
            text = texts[id(module)][1]
            if text not in parsed:
                parsed[text] = collective_ops(text)
            found += [(op, group_axes(op.groups, mesh)) for op in parsed[text]]
        cache[key] = found
    return cache[key]


def instruction_collectives(compiled, index: int, cache: dict | None = None) -> dict:
    """{kind: (launches, bytes per device)} of one run of instruction `index`'s executable (a
    `Run`), a collective in a loop counted per trip. Pass one `cache` dict to several calls to
    read each executable once."""
    out: dict = {}
    for op, _ in _task_ops(compiled, index, {} if cache is None else cache):
        n, b = out.get(op.kind, (0, 0))
        out[op.kind] = (n + op.times, b + op.times * op.bytes)
    return out


def task_collectives(compiled, name_prefix: str, kind: str, axes: tuple | None = None) -> int:
    """Launches of `kind` per step summed over task instances whose name starts with
    `name_prefix` (e.g. "bwd_", "reduce_"); with `axes`, only those spanning exactly these mesh
    axes (e.g. ("fsdp",))."""
    prog = compiled.program
    cache: dict = {}
    total = 0
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Run) and ins.code.name.startswith(name_prefix):
            for op, op_axes in _task_ops(compiled, idx, cache):
                if op.kind == kind and (axes is None or tuple(op_axes) == tuple(axes)):
                    total += op.times
    return total
