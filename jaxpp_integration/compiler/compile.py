"""Pass: turn each distinct task into a compiled SPMD executable on its group's sub-mesh.

Each `TaskCode` becomes a Python function over flat arrays (evaluating its equations, slicing the
microbatch, updating accumulators) and is compiled with `jax.jit(...).lower(...).compile()` with
explicit input shardings on its rank's mesh. Meshes captured inside equations (sharding
constraints, nested jits, shard_map) are rebound from the lowering mesh to the group's mesh.

One XLA compile per distinct program: a program is keyed by its equations as traced, its input
layouts relative to the group's sub-mesh and its donation, never by rank or device ids. The first
group that runs it compiles it; every other group gets that executable loaded onto its own
devices (`jax_compat.load_compiled_on`); other microbatches reuse their group's executable.

Several processes (multi-controller JAX): each process compiles only the programs of the groups
whose devices it owns (`local_ranks`); a program of another process's group is never compiled or
loaded here. A value sent from another process's group must still arrive in the layout its
producer's compiled program gives it (both ends of a cross-process transfer use the same spec,
`runtime/transfer.py`), and that layout is XLA's choice when the producer compiles. So the
producing process publishes its programs' output specs through `jax.distributed`'s key-value
store as each compile finishes, and a process needing one waits for it (`exchange`,
`transfer.SpecExchange`). Chosen over pinning the specs of every crossing value from the trace:
pinning would force layouts XLA did not pick (extra collectives inside stages) and would change
the programs with the process count; exchanging them keeps every program identical to the one
a single process compiles, so results stay bitwise. No deadlock: programs are compiled in
program order and a program only reads values made earlier in that order, so the earliest
program not yet compiled on any process never waits.

`task_programs` gives each distinct program back as the `jax.jit` function and abstract arguments it
was compiled from, to lower it again elsewhere (e.g. for CUDA on a host without GPUs:
`tp.fn.trace(*tp.args).lower(lowering_platforms=("cuda",))`).

With JAX's persistent compilation cache on (`jax_cache_dir`), a program may come from the cache;
XLA:CPU cannot serialize an executable it deserialized, so before loading such a program onto
other groups it is compiled once more without the cache (one extra compile per shared program
when the cache is warm; the other programs are cache reads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpp_integration.compiler.program import Fill, Program, Run, TaskCode, Transfer
from jaxpp_integration.frontend.treduce import microbatch
from jaxpp_integration.jax_compat import (
    load_compiled_on,
    persistent_cache_reads,
    persistent_cache_writes_here,
    without_persistent_cache,
)


def rebind_meshes(eqns, src_meshes, dst_mesh: Mesh):
    """Equations with every Mesh in `src_meshes` (and shardings on it) replaced by `dst_mesh`."""
    if all(m == dst_mesh for m in src_meshes):
        return eqns

    def fix(x):
        if isinstance(x, Mesh):
            return dst_mesh if x in src_meshes else x
        if isinstance(x, NamedSharding):
            if x.mesh in src_meshes:
                return NamedSharding(dst_mesh, x.spec, memory_kind=x.memory_kind)
            return x
        if isinstance(x, ClosedJaxpr):
            return ClosedJaxpr(fix(x.jaxpr), x.consts)
        if isinstance(x, Jaxpr):
            return Jaxpr(
                x.constvars,
                x.invars,
                x.outvars,
                [fix_eqn(e) for e in x.eqns],
                x.effects,
                x.debug_info,
            )
        if type(x) is tuple:
            return tuple(fix(y) for y in x)
        if type(x) is list:
            return [fix(y) for y in x]
        return x

    def fix_eqn(e):
        return e.replace(params={k: fix(v) for k, v in e.params.items()})

    return [fix_eqn(e) for e in eqns]


def make_jaxpr_of(eqns, invars, outvars, name="task") -> Jaxpr:
    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    info = DebugInfo(
        name,
        name,
        tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    return Jaxpr([], list(invars), list(outvars), list(eqns), effects, info)


def _eqns_fn(eqns, invars, outvars):
    jaxpr = make_jaxpr_of(eqns, invars, outvars)
    return jaxpr_as_fun(ClosedJaxpr(jaxpr, []))


def task_function(code: TaskCode, eqns):
    if code.kind == "before":
        run = _eqns_fn(eqns, code.invars, code.outvars)
        inits = code.acc_inits

        def before(*args):
            outs = list(run(*args[:-1]))  # the last input only pins the rank
            return outs + [op.init(n, aval) for op, n, aval in inits]

        return before
    if code.kind == "after":
        return _eqns_fn(eqns, code.invars, code.outvars)

    owned = [v for _, v in code.acc_ops]
    run = _eqns_fn(eqns, code.invars, list(code.outvars) + owned)
    n_in = len(code.invars)
    n_out = len(code.outvars)
    slices = set(code.mb_slices)
    ops = [op for op, _ in code.acc_ops]
    axis = code.mb_axis

    def loop(*args):
        index = args[-1]
        ins = [microbatch(x, index, axis) if i in slices else x for i, x in enumerate(args[:n_in])]
        accs = args[n_in:-1]
        outs = run(*ins)
        values, owned_vals = outs[:n_out], outs[n_out:]
        return list(values) + [op.update(a, v, index) for op, a, v in zip(ops, accs, owned_vals)]

    return loop


def _key(code: TaskCode):
    """What makes two tasks the same program, whatever group they run on: the task's equations
    as traced against the lowering mesh (identical text for identical stages), its kind, its
    accumulator handling and which inputs are sliced per microbatch. No rank, no device ids."""
    text = str(make_jaxpr_of(code.eqns, code.invars, code.outvars))
    return (
        code.kind,
        text,
        tuple(str(op) for op, _ in code.acc_ops),
        tuple(str(i) for i in code.acc_inits),
        code.mb_slices,
        code.mb_axis,
        code.out_specs,
    )


def _layout_key(sharding, mesh: Mesh):
    """An input sharding relative to its group's sub-mesh: the spec and memory kind, plus the
    sub-mesh's axis names and shape. Equal for the same layout on any group of one MpmdMesh."""
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return (sharding.spec, sharding.memory_kind, mesh.axis_names, mesh.devices.shape)
    return ("exact", sharding)  # another kind of sharding: only shared where it is identical


def _sds(aval, sharding):
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, sharding=sharding, weak_type=getattr(aval, "weak_type", False)
    )


def _jit_task(prog: Program, mpmd_mesh, ins: Run, in_shardings):
    """(the `jax.jit` of `ins`'s program on its group's mesh, its abstract arguments)."""
    code = ins.code
    group = mpmd_mesh.unstack[code.rank]
    eqns = rebind_meshes(code.eqns, (mpmd_mesh.lowering_mesh(), mpmd_mesh.jax_mesh), group)
    fn = task_function(code, eqns)
    if code.out_specs:
        fn = _constrained(fn, code.out_specs, group)
    avals = tuple(_sds(prog.slot_aval[s], sh) for s, sh in zip(ins.ins, in_shardings))
    return jax.jit(fn, donate_argnums=ins.donate, keep_unused=True), avals


@dataclasses.dataclass(frozen=True)
class TaskProgram:
    """One distinct task program of a compiled step: `fn` (a `jax.jit` function) applied to
    `args` (`jax.ShapeDtypeStruct`s with the input shardings it was compiled for) is the program
    `compile_program` compiled. `name` is its task (`fwd_0`, `after_loop_1_0`, ...), `rank` the
    first group running it."""

    name: str
    rank: int
    kind: str
    fn: object
    args: tuple


def task_programs(prog: Program, mpmd_mesh, slot_sharding: dict) -> list[TaskProgram]:
    """Every distinct program of `prog` once (distinct as `compile_program` counts them), in
    program order. `slot_sharding` is the shardings `compile_program` returned (a compiled
    step's `.slot_sharding`)."""
    seen, out = set(), []
    for ins in prog.instrs:
        if not isinstance(ins, Run):
            continue
        in_sh = tuple(slot_sharding[s] for s in ins.ins)
        group = mpmd_mesh.unstack[ins.code.rank]
        key = (_key(ins.code), tuple(_layout_key(sh, group) for sh in in_sh), ins.donate)
        if key in seen:
            continue
        seen.add(key)
        fn, args = _jit_task(prog, mpmd_mesh, ins, in_sh)
        out.append(TaskProgram(ins.code.name, ins.code.rank, ins.code.kind, fn, args))
    return out


@dataclasses.dataclass
class CompileStats:
    """How `compile_program` obtained the executables of one program.

    `compiles`: XLA compilations run (one per distinct program); `loads`: executables loaded
    onto another group's devices from a compilation made for a group of the same shape;
    `cache_hits`: task instances reusing an executable of their own group (other microbatches);
    `seconds`: wall time per compiled program name."""

    compiles: int = 0
    loads: int = 0
    cache_hits: int = 0
    seconds: dict = dataclasses.field(default_factory=dict)


class _Remote:
    """A slot sharding made by a program another process compiles (`out` of the specs
    `specs()` fetches from it, on `mesh` of group `rank`)."""

    __slots__ = ("specs", "out")

    def __init__(self, specs, out):
        self.specs, self.out = specs, out

    def get(self):
        return self.specs()[self.out]


def _remote_outputs(exchange, index: int, mesh):
    """A memoized fetch of the output shardings of instruction `index` (a Run on `mesh`)."""
    got: list = []

    def specs():
        if not got:
            got.append([NamedSharding(mesh, spec) for spec in exchange.fetch(index)])
        return got[0]

    return specs


def _spec_of(sharding) -> PartitionSpec:
    return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()


def _shared_runs(prog: Program) -> set:
    """Indices of Runs whose output layouts another process may need: those making a value
    that is transferred or is a step output (the same set on every process)."""
    wanted = {ins.src for ins in prog.instrs if isinstance(ins, Transfer)}
    wanted |= {s for slots in prog.outputs for s in slots.values()}
    return {
        idx
        for idx, ins in enumerate(prog.instrs)
        if isinstance(ins, Run) and any(s in wanted for s in ins.outs)
    }


def _needed_here(prog: Program, local) -> set:
    """Slots whose sharding this process needs: its groups' slots, both ends of its transfers,
    and the step outputs (every process describes every output)."""
    need = {s for s, r in enumerate(prog.slot_rank) if r in local}
    need |= {s for slots in prog.outputs for s in slots.values()}
    for ins in prog.instrs:
        if isinstance(ins, Transfer) and (ins.src_rank in local or ins.dst_rank in local):
            need |= {ins.src, ins.dst}
    return need


class _Pending:
    """A slot sharding that a compile still running will produce (`out` of `future`)."""

    __slots__ = ("future", "out")

    def __init__(self, future, out):
        self.future, self.out = future, out

    def get(self):
        return self.future.result().output_shardings[self.out]


def compile_program(
    prog: Program,
    mpmd_mesh,
    input_shardings: dict,
    cache: dict,
    compile_threads: int = 0,
    local_ranks=None,
    exchange=None,
):
    """Compiles the Runs of `prog` on `local_ranks` (default: every group); returns (executables
    per instr index, slot shardings this process needs, stats). With other groups on other
    processes, `exchange` (`publish(index, specs)`, `fetch(index)`) shares output layouts.

    A distinct program (see `_key` and `_layout_key`: no device ids) is compiled once, for the
    first group that runs it; every other group gets that executable loaded onto its own devices
    (`jax_compat.load_compiled_on`), which takes milliseconds instead of an XLA compile.
    `compile_threads > 1` compiles independent programs concurrently on that many threads (a
    task waits only for the compiles whose output shardings it reads); this pays on hosts with
    many free cores (GPU hosts), not on a small loaded CPU box."""
    stats = CompileStats()
    lock = threading.Lock()
    in_flight: dict = {}  # (program key, rank) -> Future of the executable
    programs = cache  # program key -> [(rank, Future)] of the groups it was compiled for
    fn_cache: dict = {}
    restored: dict = {}  # id(executable read from the persistent cache) -> how to lower it
    fresh: dict = {}  # program key -> Future of the program compiled without that cache
    pool = ThreadPoolExecutor(compile_threads) if compile_threads > 1 else None

    local = frozenset(range(mpmd_mesh.mpmd_dim) if local_ranks is None else local_ranks)
    assert exchange is not None or len(local) == mpmd_mesh.mpmd_dim, "remote groups need exchange"
    shared = _shared_runs(prog) if exchange is not None else set()
    slot_sharding: dict = dict(input_shardings)
    for s in prog.constants:
        slot_sharding[s] = mpmd_mesh.sharding(prog.slot_rank[s], PartitionSpec())

    def resolve(slot):
        sh = slot_sharding[slot]
        if isinstance(sh, (_Pending, _Remote)):
            sh = slot_sharding[slot] = sh.get()
        elif callable(sh):
            sh = slot_sharding[slot] = sh()
        return sh

    def code_of(code):
        with lock:
            if id(code) not in fn_cache:
                fn_cache[id(code)] = _key(code)
            return fn_cache[id(code)]

    def lower(code, ins, in_sh):
        jitted, avals = _jit_task(prog, mpmd_mesh, ins, in_sh)
        return jitted.lower(*avals)

    def compile_one(code, ins, in_sh):
        t0 = time.perf_counter()
        with persistent_cache_reads() as reads:
            exe = lower(code, ins, in_sh).compile()
        with lock:
            stats.compiles += 1
            stats.seconds[code.name] = time.perf_counter() - t0
            if reads.hits:  # not movable to other groups as it is: see `movable_source`
                restored[id(exe)] = (code, ins, in_sh)
        return exe

    def movable_source(key, exe):
        """`exe`, or, when it was read from JAX's persistent compilation cache (XLA:CPU cannot
        serialize such an executable again), the same program compiled here once without it."""
        with lock:
            how = restored.get(id(exe))
            if how is None:
                return exe
            mine = fresh.get(key)
            if mine is None:
                mine = fresh[key] = Future()
                todo = True
            else:
                todo = False
        if todo:
            with without_persistent_cache():  # lowered anew: a Lowered compiles once
                mine.set_result(lower(*how).compile())
            with lock:
                stats.compiles += 1
        return mine.result()

    def executable_for(ins):
        code = ins.code
        rank = code.rank
        in_sh = tuple(resolve(s) for s in ins.ins)
        group = mpmd_mesh.unstack[rank]
        key = (code_of(code), tuple(_layout_key(sh, group) for sh in in_sh), ins.donate)
        with lock:
            mine = in_flight.get((key, rank))
            waiting = mine is not None  # this group has it already (another microbatch)
            if waiting:
                stats.cache_hits += 1
            else:
                mine = in_flight[(key, rank)] = (rank, Future())
                sources = list(programs.get(key, ()))  # compiles of it for other groups
                if not sources:
                    programs[key] = [mine]
        _, fut = mine
        if waiting:
            return fut.result()
        try:
            exe = None
            for src_rank, src_fut in sources:  # load a compile made for another group
                exe = load_compiled_on(
                    movable_source(key, src_fut.result()),
                    mpmd_mesh.devices_of(src_rank),
                    mpmd_mesh.devices_of(rank),
                )
                if exe is not None:
                    with lock:
                        stats.loads += 1
                    break
            if exe is None:  # the first group to run it, or JAX cannot move it here
                exe = compile_one(code, ins, in_sh)
                if sources:
                    with lock:
                        programs[key].append(mine)
        except BaseException as e:
            fut.set_exception(e)
            raise
        fut.set_result(exe)
        return exe

    def compile_and_share(ins, idx):
        exe = executable_for(ins)
        if idx in shared:  # other processes may wait for these layouts
            exchange.publish(idx, [_spec_of(sh) for sh in exe.output_shardings])
        return exe

    jobs = {}
    # several processes: programs are compiled only here, so this process writes them to JAX's
    # persistent compilation cache itself (JAX writes from process 0 only)
    writes = persistent_cache_writes_here() if exchange is not None else contextlib.nullcontext()
    try:
        with writes:
            for idx, ins in enumerate(prog.instrs):
                if isinstance(ins, Transfer):

                    def moved(src=ins.src, rank=ins.dst_rank):
                        return mpmd_mesh.sharding(rank, _spec_of(resolve(src)))

                    here = ins.src_rank in local or ins.dst_rank in local
                    slot_sharding[ins.dst] = moved() if pool is None and here else moved
                elif isinstance(ins, Run) and ins.code.rank not in local:
                    specs = _remote_outputs(exchange, idx, mpmd_mesh.unstack[ins.code.rank])
                    for j, s in enumerate(ins.outs):
                        slot_sharding[s] = _Remote(specs, j)
                elif isinstance(ins, Run):
                    if pool is None:
                        job = Future()
                        job.set_result(compile_and_share(ins, idx))
                    else:
                        job = pool.submit(compile_and_share, ins, idx)
                    jobs[idx] = job
                    for j, s in enumerate(ins.outs):
                        slot_sharding[s] = _Pending(job, j)
                elif isinstance(ins, Fill):
                    spec = prog.slot_spec.get(ins.slot, PartitionSpec())
                    slot_sharding[ins.slot] = mpmd_mesh.sharding(ins.rank, spec)
            executables = {idx: job.result() for idx, job in jobs.items()}
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    need = _needed_here(prog, local) if len(local) < mpmd_mesh.mpmd_dim else slot_sharding
    lazy = lambda s: isinstance(slot_sharding[s], _Remote) or callable(slot_sharding[s])  # noqa: E731
    return executables, {s: resolve(s) for s in slot_sharding if s in need or not lazy(s)}, stats


def _constrained(fn, specs, mesh: Mesh):
    """`fn` with output i constrained to `specs[i]` on `mesh` (None: left to XLA)."""

    def wrapped(*args):
        outs = fn(*args)
        return [
            o if s is None else jax.lax.with_sharding_constraint(o, NamedSharding(mesh, s))
            for o, s in zip(outs, specs)
        ]

    return wrapped
