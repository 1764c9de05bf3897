"""Printable text of a scheduled program in jaxpr-like syntax: task, transfer and delete lines."""

from __future__ import annotations

import numpy as np

from jaxpp_integration.compiler.program import Delete, Fill, Program, Run, Transfer


def _name(i: int) -> str:
    letters = ""
    i += 1
    while i:
        i, rem = divmod(i - 1, 26)
        letters = chr(ord("a") + rem) + letters
    return letters


def _ty(aval) -> str:
    dt = np.dtype(aval.dtype)
    short = {
        "float32": "f32",
        "float16": "f16",
        "bfloat16": "bf16",
        "int32": "i32",
        "int64": "i64",
        "bool": "bool",
        "uint32": "u32",
        "float64": "f64",
    }.get(dt.name, dt.name)
    return f"{short}[{','.join(map(str, aval.shape))}]"


class ProgramText:
    def __init__(self, prog: Program):
        self.prog = prog

    def __str__(self) -> str:
        p = self.prog
        v = lambda s: f"{_name(s)}:{_ty(p.slot_aval[s])}"
        ins = " ".join(v(s) for slots in p.inputs for s in slots.values())
        lines = [f"{{ lambda ; {ins}. let"]
        for instr in p.instrs:
            if isinstance(instr, Run):
                code = instr.code
                lines.append(f"    {' '.join(v(s) for s in instr.outs) or '_'} = task[")
                info = f"({code.stage}, TaskType.{code.phase.name})" if code.phase else "None"
                lines.append(f"      task_info={info}")
                lines.append(f"      mpmd_idx={code.rank}")
                lines.append(f"      call_counter={instr.microbatch}")
                donate = tuple(i in instr.donate for i in range(len(instr.ins)))
                lines.append(f"      donate_invars={donate}")
                lines.append(f"      task_name={code.name}")
                lines.append(f"    ] {' '.join(_name(s) for s in instr.ins)}")
            elif isinstance(instr, Transfer):
                lines.append(
                    f"    {v(instr.dst)} = transfer[src_mpmd_idx={instr.src_rank} "
                    f"tgt_mpmd_idx={instr.dst_rank}] {_name(instr.src)}"
                )
            elif isinstance(instr, Fill):
                lines.append(f"    {v(instr.slot)} = fill[mpmd_idx={instr.rank}]")
            elif isinstance(instr, Delete):
                lines.append(f"    _ = delete[mpmd_idx={instr.rank}] {_name(instr.slot)}")
        outs = " ".join(_name(s) for slots in p.outputs for s in slots.values())
        lines.append(f"  in ({outs}) }}")
        return "\n".join(lines)

    def splitlines(self):
        return str(self).splitlines()


def render_program(prog: Program) -> ProgramText:
    return ProgramText(prog)
