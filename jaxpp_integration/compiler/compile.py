"""Pass: turn each distinct task into a compiled SPMD executable on its group's sub-mesh.

Each `TaskCode` becomes a Python function over flat arrays (evaluating its equations, slicing the
microbatch, updating accumulators) and is compiled with `jax.jit(...).lower(...).compile()` with
explicit input shardings on its rank's mesh. Meshes captured inside equations (sharding
constraints, nested jits, shard_map) are rebound from the lowering mesh to the group's mesh. A
loop task cut at its layer scans (`blocks.py`) is compiled piece by piece and runs as one
`ChainedExecutable`.

One XLA compile per distinct program: a program (a task, or a piece of one) is keyed by its
equations as traced, its input layouts relative to the group's sub-mesh and its donation, never
by stage, rank or device ids; so every stage's layer block of one layer count is one program.
The first group that runs it compiles it; every other group gets that executable loaded onto its
own devices (`jax_compat.load_compiled_on`); other microbatches reuse their group's executable.
Programs are named after their task (`fwd_1`, `fwd_layers`, `after_loop_0_1`): XLA's module
name, and the name JAX's compile events and logs carry.

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

`task_programs` gives each distinct program back as the `jax.jit` function and abstract
arguments it was compiled from, to lower it again elsewhere (e.g. for CUDA on a host without GPUs:
`tp.fn.trace(*tp.args).lower(lowering_platforms=("cuda",))`).

With JAX's persistent compilation cache on (`jax_cache_dir`), a program may be read from the
cache instead of compiled; XLA:CPU cannot serialize an executable it deserialized, so the copies
for other groups are loaded from the executable bytes the cache read returned. A restart with a
warm cache thus runs no XLA compile (if those bytes are unknown, e.g. under another JAX version,
a shared program is compiled once more without the cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_integration.compiler.blocks import ChainedExecutable
from jaxpp_integration.compiler.program import Fill, Program, Run, Transfer
from jaxpp_integration.compiler.shared_parts import after_loop_pieces
from jaxpp_integration.compiler.task_functions import (
    device_bytes,
    jit_piece,
    jit_task,
    layout_key,
    piece_key,
    piece_name,
    plain_sharding,
    task_key,
)
from jaxpp_integration.jax_compat import (
    load_compiled_on,
    persistent_cache_reads,
    persistent_cache_writes_here,
    without_persistent_cache,
)


@dataclasses.dataclass(frozen=True)
class TaskProgram:
    """One distinct task program of a compiled step: `fn` (a `jax.jit` function) applied to
    `args` (`jax.ShapeDtypeStruct`s with the input shardings it was compiled for) is the program
    `compile_program` compiled. `name` is its task or piece (`fwd_0`, `fwd_layers`,
    `after_loop_1_0`, ...), `rank` the first group running it."""

    name: str
    rank: int
    kind: str
    fn: object
    args: tuple


def task_programs(
    prog: Program, mpmd_mesh, slot_sharding: dict, executables: dict
) -> list[TaskProgram]:
    """Every distinct program this process compiled for `prog` once (distinct as
    `compile_program` counts them), in program order. `slot_sharding` and `executables` are
    what `compile_program` returned (a compiled step's `.slot_sharding` and `.executables`); a
    task run as several programs lists its pieces (`ChainedExecutable.programs`)."""
    seen, out = set(), []
    for idx, ins in enumerate(prog.instrs):
        if not isinstance(ins, Run) or idx not in executables:  # (another process's group)
            continue
        exe = executables[idx]
        if isinstance(exe, ChainedExecutable):
            for key, tp in exe.programs:
                if key not in seen:
                    seen.add(key)
                    out.append(tp)
            continue
        in_sh = tuple(slot_sharding[s] for s in ins.ins)
        group = mpmd_mesh.unstack[ins.code.rank]
        key = (task_key(ins.code), tuple(layout_key(sh, group) for sh in in_sh), ins.donate)
        if key in seen:
            continue
        seen.add(key)
        fn, args = jit_task(prog, mpmd_mesh, ins, in_sh)
        out.append(TaskProgram(ins.code.name, ins.code.rank, ins.code.kind, fn, args))
    return out


@dataclasses.dataclass
class CompileStats:
    """How `compile_program` obtained its executables, one per distinct program and group.

    `compiles`: XLA compilations run (`compiled`: their program names, in order);
    `persistent_hits`: programs read from JAX's persistent compilation cache (`jax_cache_dir`)
    instead; `loads`: executables loaded onto another group's devices from a program compiled
    (or read) for a group of the same shape; `cache_hits`: programs reused by another instance
    on their own group (other microbatches); `seconds`: wall time per compiled program name."""

    compiles: int = 0
    persistent_hits: int = 0
    loads: int = 0
    cache_hits: int = 0
    compiled: list = dataclasses.field(default_factory=list)
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


class _Compiler:
    """The state one `compile_program` call shares between its steps: slot shardings as they
    become known, the distinct programs compiled or in flight, and the stats.

    Steps, in the order a task meets them: `executable_for` (one program, or a chain of
    `pieces`) -> `program` (this group's copy: reused, loaded from another group's compile,
    or compiled) -> `compile_one` (the XLA compile, or a persistent-cache read). `run` walks
    the instructions once and returns what `compile_program` returns."""

    def __init__(self, prog, mpmd_mesh, input_shardings, cache, compile_threads, local, exchange):
        self.prog, self.mesh, self.exchange, self.local = prog, mpmd_mesh, exchange, local
        self.stats = CompileStats()
        self.lock = threading.RLock()
        self.in_flight: dict = {}  # (program key, rank) -> Future of the executable
        self.programs = cache  # program key -> [(rank, Future)] of the groups it was compiled for
        self.fn_cache: dict = {}
        self.recipes_made: dict = {}
        self.restored: dict = {}  # id(executable read from the persistent cache) -> how to lower
        self.fresh: dict = {}  # program key -> Future of the program compiled without that cache
        self.pool = ThreadPoolExecutor(compile_threads) if compile_threads > 1 else None
        self.shared = _shared_runs(prog) if exchange is not None else set()
        self.slot_sharding: dict = dict(input_shardings)
        for s in prog.constants:
            self.slot_sharding[s] = mpmd_mesh.sharding(prog.slot_rank[s], PartitionSpec())
        # (programs are shared only between this process's groups)
        codes = list({id(i.code): i.code for i in prog.instrs if isinstance(i, Run)}.values())
        self.after_pieces = after_loop_pieces([c for c in codes if c.rank in local])

    # ------------------------------------------------------------------ slots and programs

    def resolve(self, slot):
        """The sharding of `slot`, waiting for the compile (or the process) that makes it."""
        sh = self.slot_sharding[slot]
        if isinstance(sh, (_Pending, _Remote)):
            sh = self.slot_sharding[slot] = sh.get()
        elif callable(sh):
            sh = self.slot_sharding[slot] = sh()
        return sh

    def pieces(self, code):
        """The programs a task runs: a loop task cut at its layer scans (`TaskCode.pieces`),
        an after-loop task's shared and own parts (`after_loop_pieces`), or () for one."""
        return code.pieces if code.kind == "loop" else self.after_pieces.get(id(code), ())

    def key_of(self, code, j=None):
        with self.lock:
            if (id(code), j) not in self.fn_cache:
                self.fn_cache[(id(code), j)] = (
                    task_key(code) if j is None else piece_key(code, self.pieces(code)[j])
                )
            return self.fn_cache[(id(code), j)]

    def recipe_of(self, code, j, avals, in_sh, donate) -> TaskProgram:
        """How piece `j` of `code` is compiled with these inputs (made once: every other
        microbatch's instance reuses it)."""
        key = (id(code), j, tuple(in_sh), donate)
        with self.lock:
            if key not in self.recipes_made:
                piece = self.pieces(code)[j]
                jitted, args = jit_piece(self.mesh, code, piece, avals, in_sh, donate)
                self.recipes_made[key] = TaskProgram(
                    piece_name(code, piece), code.rank, code.kind, jitted, args
                )
            return self.recipes_made[key]

    # ------------------------------------------------------------- obtaining an executable

    def compile_one(self, name, lowering):
        t0 = time.perf_counter()
        with persistent_cache_reads() as reads:
            exe = lowering().compile()
        with self.lock:
            if reads.hits:  # read from jax_cache_dir, not compiled: see `movable_source`
                self.stats.persistent_hits += 1
                serialized = reads.serialized[-1] if reads.serialized else None
                self.restored[id(exe)] = (lowering, serialized)
            else:
                self.stats.compiles += 1
                self.stats.compiled.append(name)
            self.stats.seconds[name] = time.perf_counter() - t0
        return exe

    def movable_source(self, key, exe):
        """(`exe`, its serialized bytes if at hand). An executable read from JAX's persistent
        compilation cache is moved from the bytes read (XLA:CPU cannot serialize it again); if
        those are unknown, the program is compiled here once more, without the cache."""
        with self.lock:
            how = self.restored.get(id(exe))
            if how is None:
                return exe, None
            lowering, serialized = how
            if serialized is not None:
                return exe, serialized
            mine = self.fresh.get(key)
            todo = mine is None
            if todo:
                mine = self.fresh[key] = Future()
        if todo:
            with without_persistent_cache():  # lowered anew: a Lowered compiles once
                mine.set_result(lowering().compile())
            with self.lock:
                self.stats.compiles += 1
                self.stats.compiled.append("(again, uncached)")
        return mine.result(), None

    def program(self, key, rank, name, lowering):
        """The executable of one distinct program on group `rank`: its own (another microbatch
        made it), loaded from another group's compile, or compiled here."""
        with self.lock:
            mine = self.in_flight.get((key, rank))
            waiting = mine is not None  # this group has it already (another microbatch)
            if waiting:
                self.stats.cache_hits += 1
            else:
                mine = self.in_flight[(key, rank)] = (rank, Future())
                sources = list(self.programs.get(key, ()))  # compiles of it for other groups
                if not sources:
                    self.programs[key] = [mine]
        _, fut = mine
        if waiting:
            return fut.result()
        try:
            exe = self._load_from(sources, key, rank, name)
            if exe is None:  # the first group to run it, or JAX cannot move it here
                exe = self.compile_one(name, lowering)
                if sources:
                    with self.lock:
                        self.programs[key].append(mine)
        except BaseException as e:
            fut.set_exception(e)
            raise
        fut.set_result(exe)
        return exe

    def _load_from(self, sources, key, rank, name):
        """`key`'s executable loaded onto group `rank` from the first compile made for another
        group, or None (JAX cannot move it, or moving it failed: the others would fail alike)."""
        if not sources:
            return None
        src_rank, src_fut = sources[0]
        source, serialized = self.movable_source(key, src_fut.result())
        exe = load_compiled_on(
            source,
            self.mesh.devices_of(src_rank),
            self.mesh.devices_of(rank),
            serialized,
            name=f"{name} (group {src_rank}'s compile)",
        )
        if exe is not None:
            with self.lock:
                self.stats.loads += 1
        return exe

    # --------------------------------------------------------------------------- one task

    def executable_for(self, ins):
        code = ins.code
        in_sh = tuple(self.resolve(s) for s in ins.ins)
        parts = self.pieces(code)
        if parts:
            return self.chained(ins, in_sh, parts)
        group = self.mesh.unstack[code.rank]
        key = (self.key_of(code), tuple(layout_key(sh, group) for sh in in_sh), ins.donate)

        def lower():
            jitted, avals = jit_task(self.prog, self.mesh, ins, in_sh)
            return jitted.lower(*avals)

        return self.program(key, code.rank, code.name, lower)

    def chained(self, ins, in_sh, parts):
        """A task run as several programs (`pieces`): each piece is compiled (or loaded) as
        a program of its own, shared by every stage and group where it is identical, and the
        pieces are chained into one executable for the task."""
        code = ins.code
        group = self.mesh.unstack[code.rank]
        loop = code.kind == "loop"
        n_args, n_in = len(ins.ins), len(code.invars)
        env_sh = list(in_sh)
        env_aval = [self.prog.slot_aval[s] for s in ins.ins]
        where = {v: i for i, v in enumerate(code.invars)}
        acc_at = {k: n_in + k for k in range(len(code.acc_ops))}
        reads = [
            [where.get(v) for v in piece.invars] + [n_in + k for k in piece.owned]
            for piece in parts
        ]
        last_reader = {p: j for j, args in enumerate(reads) for p in args if p is not None}
        steps, recipes, donated = [], [], set()
        for j, piece in enumerate(parts):
            args = [where[v] for v in piece.invars] + [acc_at[k] for k in piece.owned]
            if loop:
                args.append(n_args - 1)  # the microbatch index
            # A donated task input goes to the last piece reading it, but for a scalar: a
            # scalar (a step count, a clip factor) is read by a varying number of a group's
            # parts, so its donation would make a part shared by groups differ per group; the
            # chain deletes such inputs after its last piece (`ChainedExecutable.consume`).
            donate = tuple(
                a
                for a, p in enumerate(args)
                if p < n_args
                and p in ins.donate
                and last_reader.get(p) == j
                and env_aval[p].shape != ()
            )
            donated.update(args[a] for a in donate)
            p_sh = tuple(env_sh[p] for p in args)
            p_aval = [env_aval[p] for p in args]
            key = (self.key_of(code, j), tuple(layout_key(sh, group) for sh in p_sh), donate)
            recipe = self.recipe_of(code, j, p_aval, p_sh, donate)
            exe = self.program(key, code.rank, recipe.name, lambda r=recipe: r.fn.lower(*r.args))
            recipes.append((key, recipe))
            out_sh = [plain_sharding(sh, group) for sh in exe.output_shardings]
            for v, sh in zip(piece.outvars, out_sh):
                where[v] = len(env_sh)
                env_sh.append(sh)
                env_aval.append(v.aval)
            for k, sh in zip(piece.owned, out_sh[len(piece.outvars) :]):
                env_aval.append(env_aval[acc_at[k]])
                acc_at[k] = len(env_sh)
                env_sh.append(sh)
            steps.append((exe, args))
        results = [where[v] for v in code.outvars] + [acc_at[k] for k in range(len(code.acc_ops))]
        chain = ChainedExecutable(
            steps,
            results,
            n_args,
            in_sh,
            [env_sh[p] for p in results],
            [device_bytes(a, sh) for a, sh in zip(env_aval, env_sh)],
            consume=[p for p in ins.donate if p not in donated],
        )
        chain.programs = recipes  # (program key, how it was compiled): see `task_programs`
        return chain

    def compile_and_share(self, ins, idx):
        exe = self.executable_for(ins)
        if idx in self.shared:  # other processes may wait for these layouts
            self.exchange.publish(idx, [_spec_of(sh) for sh in exe.output_shardings])
        return exe

    # ----------------------------------------------------------------- the whole program

    def visit(self, idx, ins, jobs):
        """Records what instruction `idx` makes: a transfer's destination layout, another
        process's outputs, a compile job (started now, or on the pool), a fill's layout."""
        mesh, slot_sharding = self.mesh, self.slot_sharding
        if isinstance(ins, Transfer):

            def moved(src=ins.src, rank=ins.dst_rank):
                return mesh.sharding(rank, _spec_of(self.resolve(src)))

            here = ins.src_rank in self.local or ins.dst_rank in self.local
            slot_sharding[ins.dst] = moved() if self.pool is None and here else moved
        elif isinstance(ins, Run) and ins.code.rank not in self.local:
            specs = _remote_outputs(self.exchange, idx, mesh.unstack[ins.code.rank])
            for j, s in enumerate(ins.outs):
                slot_sharding[s] = _Remote(specs, j)
        elif isinstance(ins, Run):
            if self.pool is None:
                job = Future()
                job.set_result(self.compile_and_share(ins, idx))
            else:
                job = self.pool.submit(self.compile_and_share, ins, idx)
            jobs[idx] = job
            for j, s in enumerate(ins.outs):
                slot_sharding[s] = _Pending(job, j)
        elif isinstance(ins, Fill):
            spec = self.prog.slot_spec.get(ins.slot, PartitionSpec())
            slot_sharding[ins.slot] = mesh.sharding(ins.rank, spec)

    def run(self):
        jobs = {}
        # several processes: programs are compiled only here, so this process writes them to
        # JAX's persistent compilation cache itself (JAX writes from process 0 only)
        writes = (
            persistent_cache_writes_here()
            if self.exchange is not None
            else contextlib.nullcontext()
        )
        try:
            with writes:
                for idx, ins in enumerate(self.prog.instrs):
                    self.visit(idx, ins, jobs)
                executables = {idx: job.result() for idx, job in jobs.items()}
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
        return executables, self.slot_shardings_needed(), self.stats

    def slot_shardings_needed(self) -> dict:
        """The slot shardings this process needs (all of them on a single process), resolved."""
        prog, local, slot_sharding = self.prog, self.local, self.slot_sharding
        need = _needed_here(prog, local) if len(local) < self.mesh.mpmd_dim else slot_sharding

        def lazy(s):
            return isinstance(slot_sharding[s], _Remote) or callable(slot_sharding[s])

        return {s: self.resolve(s) for s in list(slot_sharding) if s in need or not lazy(s)}


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

    A distinct program (see `task_key` and `layout_key`: no device ids) is compiled once, for the
    first group that runs it; every other group gets that executable loaded onto its own devices
    (`jax_compat.load_compiled_on`), which takes milliseconds instead of an XLA compile.
    `compile_threads > 1` compiles independent programs concurrently on that many threads (a
    task waits only for the compiles whose output shardings it reads); this pays on hosts with
    many free cores (GPU hosts), not on a small loaded CPU box. The steps: `_Compiler`."""
    local = frozenset(range(mpmd_mesh.mpmd_dim) if local_ranks is None else local_ranks)
    assert exchange is not None or len(local) == mpmd_mesh.mpmd_dim, "remote groups need exchange"
    compiler = _Compiler(prog, mpmd_mesh, input_shardings, cache, compile_threads, local, exchange)
    return compiler.run()
