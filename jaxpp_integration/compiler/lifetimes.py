"""Pass: lifetimes of a `Program`'s values: the in-place update and the deletes.

Takes the program `program.build_program` made and the step inputs the caller lets it consume
(`donate_argnums`), and guarantees:
- `donate_at_last_use`: each after-loop task donates the inputs it is the last to read whenever
  an output of the same shape and dtype can take their buffer (the optimizer writes the new
  parameters and moments into the old ones);
- `add_deletes`: a `Delete` right after every value's last use (or right after it is made, if
  unused), never for a step output, a constant or a step input the caller keeps; a value a task
  consumed gets `Delete(donated=True)`, which only closes the books.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxpp_integration.compiler.program import Delete, Fill, Program, Run, Transfer


def _kept(prog: Program, donated_inputs: set) -> set:
    """Slots the step must not free: its outputs, the constants, and the inputs it was not
    given to consume (`donated_inputs`: positions of the flat step inputs it may)."""
    keep = {s for slots in prog.outputs for s in slots.values()}
    keep |= set(prog.constants)
    for i, slots in enumerate(prog.inputs):
        if i not in donated_inputs:
            keep |= set(slots.values())
    return keep


def donate_at_last_use(prog: Program, donated_inputs: set) -> Program:
    """In-place update: each after-loop task donates the inputs it is the last to read
    (parameters and optimizer state given with `donate_argnums`, gradient accumulators, ...),
    so XLA writes its outputs into their buffers and the update never holds two copies.

    Only inputs an output can take are donated: one output per input, of the same shape and
    dtype (the pairing `jax.jit` makes; a donated input without one would stay alive), the
    state inputs first. Loop tasks keep their own donation (the accumulators)."""
    keep = _kept(prog, donated_inputs)
    state = {s for i in donated_inputs for s in prog.inputs[i].values()}
    last_use: dict = {}
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Run):
            for s in ins.ins:
                last_use[s] = idx
        elif isinstance(ins, Transfer):
            last_use[ins.src] = idx
    for idx, ins in enumerate(prog.instrs):
        if not isinstance(ins, Run) or ins.code.kind != "after" or ins.donate:
            continue
        free: dict = {}  # (shape, dtype) -> outputs of that type still without an input
        for s in ins.outs:
            key = _type_key(prog.slot_aval[s])
            free[key] = free.get(key, 0) + 1
        once = {s for s, n in collections.Counter(ins.ins).items() if n == 1}
        candidates = [
            p
            for p, s in enumerate(ins.ins)
            if s in once and s not in keep and last_use.get(s) == idx
        ]
        candidates.sort(key=lambda p: (ins.ins[p] not in state, p))
        chosen = []
        for p in candidates:
            key = _type_key(prog.slot_aval[ins.ins[p]])
            if free.get(key, 0):
                free[key] -= 1
                chosen.append(p)
        if chosen:
            prog.instrs[idx] = dataclasses.replace(ins, donate=tuple(sorted(chosen)))
    return prog


def _type_key(aval):
    return tuple(aval.shape), np.dtype(aval.dtype)


def add_deletes(prog: Program, donated_inputs: set) -> Program:
    """Inserts a Delete after each slot's last use (or right after it is made, if unused)."""
    keep = _kept(prog, donated_inputs)
    last_use: dict = {}
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Run):
            for s in ins.ins:
                last_use[s] = idx
            for s in ins.outs:
                last_use.setdefault(s, idx)
        elif isinstance(ins, Transfer):
            last_use[ins.src] = idx
            last_use.setdefault(ins.dst, idx)
        elif isinstance(ins, Fill):
            last_use.setdefault(ins.slot, idx)
    donated_by_run = set()
    for ins in prog.instrs:
        if isinstance(ins, Run):
            donated_by_run.update(ins.ins[d] for d in ins.donate)
    frees: dict = {}
    for s, idx in last_use.items():
        if s in keep:
            continue
        frees.setdefault(idx, []).append(s)
    out = []
    for idx, ins in enumerate(prog.instrs):
        out.append(ins)
        for s in sorted(frees.get(idx, ())):
            out.append(Delete(s, prog.slot_rank[s], donated=s in donated_by_run))
    prog.instrs = out
    return prog
