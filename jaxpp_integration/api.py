"""The public API: `mpmd_jit_with_loop`, and re-exports of markers, treduce, meshes, schedules.

`mpmd_jit_with_loop(fn, mpmd_mesh=...)` runs the passes in this order (one module each, see
`_compile`): trace (`frontend.treduce.pipelined_tracing`) → choose per mesh axis which
data-parallel sums wait for one reduction per step and defer them (`compiler.reduction_plan`,
`compiler.unreduced`) → cluster the loop body
(`compiler.partition`) → place work outside the loop (`compiler.placement`) → unroll, order by
schedule, transfers (`compiler.program.build_program`) → in-place update and deletes
(`compiler.lifetimes`) → compile per group (`compiler.compile`) →
prepare the walk (`runtime.executor.prepare`) → run (`runtime.executor.execute`).
`compiled.report()` describes the result (`tools.report`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_integration.compiler import lifetimes as _lifetimes
from jaxpp_integration.compiler import partition as _partition
from jaxpp_integration.compiler import placement as _placement
from jaxpp_integration.compiler import program as _program
from jaxpp_integration.compiler import reduction_plan as _reduction
from jaxpp_integration.compiler.compile import compile_program
from jaxpp_integration.compiler.reduction_plan import AutoReduction, ReductionChoice
from jaxpp_integration.compiler.render import render_program
from jaxpp_integration.frontend.array import MpmdArray
from jaxpp_integration.frontend.marker import (
    forward_pass,
    mark_stage_end,
    pipeline_enter_stage,
    pipeline_yield,
)
from jaxpp_integration.frontend.mesh import MpmdMesh
from jaxpp_integration.frontend.reductions import Add, Concat, Max
from jaxpp_integration.frontend.treduce import pipelined_tracing, treduce
from jaxpp_integration.jax_compat import wait_at_barrier
from jaxpp_integration.runtime.executor import DeviceBytes, execute, prepare
from jaxpp_integration.runtime.fetch import Fetch, fetch, fetch_later
from jaxpp_integration.runtime.reshard import mpmd_to_spmd_reshard
from jaxpp_integration.runtime.transfer import CrossBatch, Link, SpecExchange
from jaxpp_integration.runtime.watchdog import Watchdog, describe_instruction
from jaxpp_integration.schedules import (
    DualPipeV,
    Eager1F1B,
    FusedTask,
    GPipe,
    Interleaved1F1B,
    Schedule,
    ScheduleError,
    Std1F1B,
    Task,
    UserSchedule,
    ZeroBubble,
    schedule_from_name,
)
from jaxpp_integration.tools.memory import MemoryReport
from jaxpp_integration.tools.report import EngineReport, build_report

__all__ = [
    "Add",
    "AutoReduction",
    "Concat",
    "DeviceBytes",
    "DualPipeV",
    "Eager1F1B",
    "FusedTask",
    "GPipe",
    "Interleaved1F1B",
    "EngineOptions",
    "EngineReport",
    "Fetch",
    "Max",
    "MemoryReport",
    "MpmdArray",
    "MpmdMesh",
    "Schedule",
    "ScheduleError",
    "Std1F1B",
    "Task",
    "UserSchedule",
    "ZeroBubble",
    "fetch",
    "fetch_later",
    "forward_pass",
    "local_ranks",
    "mark_stage_end",
    "mpmd_jit_with_loop",
    "mpmd_to_spmd_reshard",
    "pipeline_enter_stage",
    "pipeline_yield",
    "schedule_from_name",
    "split_microbatches",
    "treduce",
]


def split_microbatches(x, n_microbatches: int, axis: int = 0):
    """Reshapes every leaf's `axis` into (n_microbatches, size / n_microbatches)."""

    def split(a):
        size = a.shape[axis]
        if size % n_microbatches:
            raise ValueError(
                f"batch dimension {size} is not divisible by {n_microbatches} microbatches; "
                f"use a batch size that is a multiple of {n_microbatches}"
            )
        shape = (*a.shape[:axis], n_microbatches, size // n_microbatches, *a.shape[axis + 1 :])
        return a.reshape(shape)

    return jax.tree.map(split, x)


def _aval_of(x):
    if isinstance(x, MpmdArray):
        if not x.arrays:
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        a = x.first_array
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=jax.typeof(a).weak_type)
    t = jax.typeof(x)
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type)


def _flat_specs(specs, args, what) -> list:
    leaves = jax.tree.leaves(args)
    if specs is None:
        return [x.spec if isinstance(x, MpmdArray) else PartitionSpec() for x in leaves]
    out: list = []
    is_spec = lambda s: isinstance(s, PartitionSpec) or s is None

    def expand(spec, sub):
        out.extend([spec if spec is not None else PartitionSpec()] * len(jax.tree.leaves(sub)))

    try:
        jax.tree.map(expand, specs, args, is_leaf=is_spec)
    except ValueError as e:
        raise ValueError(f"{what} is not a pytree prefix of the arguments: {e}") from None
    if len(out) != len(leaves):
        raise ValueError(f"{what} covers {len(out)} leaves but there are {len(leaves)}")
    return out


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The keyword arguments of `mpmd_jit_with_loop`, checked once (see its docstring)."""

    in_specs: Any = None
    out_specs: Any = None
    donate_argnums: tuple = ()
    compile_threads: int = 0
    gradient_reduction: Any = "auto"  # "auto" | "step" | "microbatch" | AutoReduction(...)
    pipeline_hang_timeout_s: float | None = None
    pipeline_fsdp_ag_once: bool = False

    def __post_init__(self):
        donate = self.donate_argnums
        object.__setattr__(
            self, "donate_argnums", tuple((donate,) if isinstance(donate, int) else donate)
        )
        object.__setattr__(self, "compile_threads", int(self.compile_threads))
        object.__setattr__(self, "pipeline_fsdp_ag_once", bool(self.pipeline_fsdp_ag_once))
        _reduction.check_mode(self.gradient_reduction)
        timeout = self.pipeline_hang_timeout_s
        if timeout is not None and not timeout >= 0:
            raise ValueError(
                f"pipeline_hang_timeout_s={timeout!r} must be >= 0 seconds (0 or None: no watchdog)"
            )


@dataclasses.dataclass
class CompiledMpmdFunction:
    """A step traced, partitioned, scheduled and compiled for one argument structure."""

    mpmd_mesh: MpmdMesh
    program: Any
    executables: dict
    slot_sharding: dict
    in_tree: Any
    in_avals: list
    in_specs: list
    out_tree: Any
    out_specs: list | None
    n_args: int
    consts: list
    schedule: Schedule
    walk: Any  # runtime.executor.Walk: the program as the runtime runs it on this process
    local_ranks: frozenset = frozenset()
    compile_stats: Any = None  # compile.CompileStats: XLA compiles vs executables loaded
    last_events: list | None = None
    last_device_bytes: DeviceBytes | None = None
    watchdog: Watchdog | None = None
    reduction_choice: ReductionChoice | None = None  # what gradient_reduction decided
    input_transfers: dict = dataclasses.field(default_factory=dict)  # see `_place_input`
    _report: EngineReport | None = None
    _ran: bool = False

    @property
    def closed_jaxpr(self):
        """The scheduled program as printable text (task, transfer and delete lines)."""
        return render_program(self.program)

    @property
    def num_executables(self) -> int:
        return len({id(e) for e in self.executables.values()})

    def report(self) -> EngineReport:
        """Every task instance (kind, phase, stage, group, FLOPs, bytes, XLA memory), transfer,
        step input and memory event of the compiled step (`tools.report`); computed once."""
        if self._report is None:
            self._report = build_report(
                self.program, self.executables, self.slot_sharding, self.mpmd_mesh, self.schedule
            )
        return self._report

    @property
    def last_memory(self) -> MemoryReport | None:
        """Logical bytes alive per group over a step (whole arrays, from shapes in program
        order; the same for every step of this program): None before the first step."""
        return self.walk.memory if self._ran else None

    def __call__(self, *args, record_times: bool = False, measure_device_bytes: bool = False):
        """Runs one step. `record_times`: block on each task and keep its start and end in
        `last_events`. `measure_device_bytes`: keep the bytes of the device buffers alive per
        device after every instruction in `last_device_bytes` (a `DeviceBytes`)."""
        leaves, tree = jax.tree.flatten(args)
        if tree != self.in_tree:
            raise TypeError(
                f"arguments do not match the compiled pytree: expected {self.in_tree}, got {tree}; "
                "pass the same structure or call .compile() again"
            )
        for i, (x, want) in enumerate(zip(leaves, self.in_avals)):
            shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
            if shape is None or dtype is None:
                got = _aval_of(x)
                shape, dtype = got.shape, got.dtype
            if tuple(shape) != want.shape or dtype != want.dtype:
                raise TypeError(
                    f"argument leaf {i} is {dtype}{list(shape)} but the function was "
                    f"compiled for {want.dtype}{list(want.shape)}; call .compile() again"
                )
        values = [*leaves, *self.consts]
        inputs, moves = {}, []  # moves: (slot, value, sharding) to place in one call
        for j, slots in enumerate(self.program.inputs):
            for r, s in slots.items():
                v = self._place_input(values[j], r, self.slot_sharding[s], s, moves)
                if v is not None:
                    inputs[s] = v
        if moves:
            placed = jax.device_put([v for _, v, _ in moves], [sh for _, _, sh in moves])
            for (s, _, _), v in zip(moves, placed):
                inputs[s] = v
            del placed
        del values, leaves, moves
        probe = DeviceBytes() if measure_device_bytes else None
        try:
            outs, events = execute(
                self.walk, inputs, record_times=record_times, watchdog=self.watchdog, probe=probe
            )
        finally:
            if self.watchdog is not None:
                self.watchdog.leave()
        self._ran = True
        self.last_events = events
        if measure_device_bytes:
            self.last_device_bytes = probe
        arrays = [
            MpmdArray(
                self.mpmd_mesh,
                {r: a for r, a in per_rank.items() if r in self.local_ranks},
                mpmd_idxs=idxs,
                aval=aval,
                spec=spec,
            )
            for per_rank, (idxs, aval, spec) in zip(outs, self._out_meta)
        ]
        for i, spec in self._respec:
            arrays[i] = _respec(arrays[i], spec)
        return jax.tree.unflatten(self.out_tree, arrays)

    @functools.cached_property
    def _out_meta(self) -> list:
        """Per step output: (groups holding it, aval, spec), the same every step."""
        out = []
        for slots in self.program.outputs:
            first = next(iter(slots.values()))
            out.append(
                (tuple(slots), self.program.slot_aval[first], self.slot_sharding[first].spec)
            )
        return out

    @functools.cached_property
    def _respec(self) -> list:
        """(output position, spec) of the outputs whose layout is not yet the `out_specs` one."""
        if self.out_specs is None:
            return []
        out = []
        for i, (slots, spec) in enumerate(zip(self.program.outputs, self.out_specs)):
            for r, s in slots.items():
                if self.slot_sharding[s] != NamedSharding(self.mpmd_mesh.unstack[r], spec):
                    out.append((i, spec))
                    break
        return out

    def _place_input(self, x, rank, sharding, slot, moves):
        """`x` on group `rank` with `sharding`; None when that group is another process's, or
        when it must be copied there: then (slot, value, sharding) goes to `moves`, which the
        caller places in one `jax.device_put`.

        An `MpmdArray` that group `rank` does not hold is sent from the first group that does:
        a copy on one host, a collective between the two processes under multi-controller JAX
        (every process visits the inputs in the same order, so the collectives match)."""
        here = rank in self.local_ranks
        if isinstance(x, MpmdArray):
            src = rank if rank in x.mpmd_idxs else x.mpmd_idxs[0]
            src_here = src in self.local_ranks
            if src_here and here:
                arr = x.array_on(src)
                if src == rank and arr.sharding == sharding:
                    return arr
                moves.append((slot, arr, sharding))
                return None
            if src == rank or not (src_here or here):
                return None
            key = (src, rank, x.spec, x.shape, x.dtype)  # its program and receive buffer, kept
            if key not in self.input_transfers:
                mesh = self.mpmd_mesh
                link = Link(
                    mesh.sharding(src, x.spec), mesh.sharding(rank, x.spec), x.shape, x.dtype
                )
                self.input_transfers[key] = CrossBatch([link], src_here, mesh.mpmd_axis_name)
            got, _ = self.input_transfers[key]([x.array_on(src)] if src_here else None)
            if got is None:  # sent: the receiving process places it
                return None
            x = got[0]
        if not here:
            return None
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        moves.append((slot, x, sharding))
        return None


def _respec(a: MpmdArray, spec: PartitionSpec) -> MpmdArray:
    fixed = {}
    for r, arr in a.arrays.items():
        want = NamedSharding(a.mpmd_mesh.unstack[r], spec)
        fixed[r] = arr if arr.sharding == want else jax.device_put(arr, want)
    return MpmdArray(a.mpmd_mesh, fixed, mpmd_idxs=a.mpmd_idxs, aval=a, spec=spec)


class MpmdFunction:
    """What `mpmd_jit_with_loop` returns: call it, or `.compile(*args)` ahead of time."""

    def __init__(self, fn, mpmd_mesh: MpmdMesh, options: EngineOptions | None = None):
        if not isinstance(mpmd_mesh, MpmdMesh):
            raise TypeError(f"mpmd_mesh must be an MpmdMesh, got {type(mpmd_mesh).__name__}")
        self.fn = fn
        self.mpmd_mesh = mpmd_mesh
        self.options = options or EngineOptions()
        self._compiled: CompiledMpmdFunction | None = None

    def compile(self, *args) -> CompiledMpmdFunction:
        self._compiled = _compile(self, args)
        return self._compiled

    @property
    def compiled(self) -> CompiledMpmdFunction | None:
        """What the last `.compile()` or first call compiled (None before that)."""
        return self._compiled

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten(args)
        c = self._compiled
        if (
            c is None
            or tree != c.in_tree
            or [(a.shape, a.dtype) for a in map(_aval_of, leaves)]
            != [(a.shape, a.dtype) for a in c.in_avals]
        ):
            c = self.compile(*args)
        return c(*args)


def mpmd_jit_with_loop(fn=None, *, mpmd_mesh, **options):
    """Pipelines the single `treduce` loop of `fn` over the groups of `mpmd_mesh`.

    Options (keyword arguments, `EngineOptions`):

    `in_specs` / `out_specs`: `PartitionSpec`s over the axes inside a group (a pytree prefix of
    the arguments / outputs); inferred when omitted. `donate_argnums`: arguments the step may
    consume (as in `jax.jit`); the after-loop tasks update them in place.

    `compile_threads > 1` compiles independent task programs concurrently (for hosts with many
    free cores, e.g. GPU hosts; on a 2-core CPU it does not pay, so the default is off).

    `gradient_reduction` (the values `treduce` adds: gradients, loss sums, token counts),
    per mesh axis that splits the batch rows (`compiler/reduction_plan.py`): "auto" (default)
    keeps them unreduced over the axes their weight is replicated on (data) and reduces them
    once per step after the loop, and reduce-scatters them into the weight's shard every
    microbatch over the axes it is sharded on (fsdp), unless full-size partials fit the device
    memory (`AutoReduction(device_memory_bytes=...)` to decide for other devices than these);
    "step" defers over every axis (full-size partials over fsdp); both equal `jax.jit` up to
    the order of the sums (~1e-7 relative). "microbatch" reduces them in every task instance
    (bitwise equal to `jax.jit`). `compiled.reduction_choice` says what was chosen.

    `pipeline_hang_timeout_s`: under several processes, a process that waits longer than this
    for a cross-process transfer prints where it is in the schedule (instruction, task,
    microbatch, the group waited on) and exits with code 3 (`watchdog.py`); None or 0: off.

    `pipeline_fsdp_ag_once`: weights sharded over the axes that split the batch (fsdp) are
    gathered once per step per group and reused by every microbatch (all-gathers per step
    independent of the number of microbatches; the gathered copies stay alive through the
    loop and show in `last_memory`). Default False: each task gathers what it needs."""
    names = {f.name for f in dataclasses.fields(EngineOptions)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(
            f"mpmd_jit_with_loop got unknown option(s) {', '.join(unknown)}; "
            f"the options are {', '.join(sorted(names))}"
        )
    opts = EngineOptions(**options)
    if fn is None:
        return lambda f: MpmdFunction(f, mpmd_mesh, opts)
    return MpmdFunction(fn, mpmd_mesh, opts)


def _compile(f: MpmdFunction, args) -> CompiledMpmdFunction:
    mesh, opts = f.mpmd_mesh, f.options
    leaves, in_tree = jax.tree.flatten(args)
    avals = [_aval_of(x) for x in leaves]
    specs = [mesh.check_spec(s, "in_specs") for s in _flat_specs(opts.in_specs, args, "in_specs")]

    def flat_fn(*flat):
        return f.fn(*jax.tree.unflatten(in_tree, flat))

    with pipelined_tracing(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh.lowering_mesh(), jax.set_mesh(mesh.lowering_mesh()):
            closed, out_shape = jax.make_jaxpr(lambda *a: flat_fn(*a), return_shape=True)(*avals)
    out_tree = jax.tree.structure(out_shape)
    jaxpr = closed.jaxpr

    _, loop_eqn, _ = _placement.split_at_loop(jaxpr)
    schedule = loop_eqn.params["schedule"]
    if schedule is None:
        raise ValueError(
            "treduce under mpmd_jit_with_loop needs a schedule, e.g. Std1F1B(mpmd_dim)"
        )
    if schedule.mpmd_dim != mesh.mpmd_dim:
        raise ValueError(
            f"{schedule!r} is for {schedule.mpmd_dim} groups but the MpmdMesh has {mesh.mpmd_dim}; "
            f"build the schedule with mpmd_dim={mesh.mpmd_dim}"
        )
    n_mb = loop_eqn.params["n_microbatches"]
    # Every process walks one global instruction order, so the transfers between any two
    # processes pair up for every schedule the validator accepts.
    schedule.validate(n_mb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh.lowering_mesh():
            reductions = _reduction.plan_reductions(jaxpr, specs, mesh, opts.gradient_reduction)
    loop_body, deferred = reductions.body, reductions.deferred
    body = _partition.partition_body(
        loop_body,
        loop_eqn.params["n_consts"],
        schedule.num_stages,
        schedule.split_backward,
    )
    top_for_body = dict(zip(loop_body.jaxpr.invars, loop_eqn.invars))
    loop_in_need: dict = {}
    for (stage, _), task in body.tasks.items():
        for v in task.invars:
            if v in top_for_body and _placement.is_var(top_for_body[v]):
                loop_in_need.setdefault(top_for_body[v], set()).add(schedule.stage_to_rank(stage))
    loop_out_ranks = [schedule.stage_to_rank(stage) for stage, _ in body.output_owner]
    place = _placement.place(jaxpr, loop_out_ranks, loop_in_need, mesh.mpmd_dim)
    prog = _program.build_program(
        _program.StepParts(
            closed=closed,
            placement=place,
            body=body,
            schedule=schedule,
            n_mb=n_mb,
            ops=loop_eqn.params["ops"],
            axis=loop_eqn.params["axis"],
            loop_need=loop_in_need,
            deferred=deferred,
            loop_body=loop_body,
            gather_specs=(
                _reduction.gather_specs(jaxpr, specs) if opts.pipeline_fsdp_ag_once else None
            ),
            reduce_specs=reductions.reduce_specs,
        )
    )
    donated = {i for i, leaf_arg in enumerate(_arg_index(args)) if leaf_arg in opts.donate_argnums}
    prog = _lifetimes.donate_at_last_use(prog, donated)
    prog = _lifetimes.add_deletes(prog, donated)

    input_specs = specs + [PartitionSpec()] * len(closed.consts)
    input_shardings = {}
    for j, slots in enumerate(prog.inputs):
        for r, s in slots.items():
            input_shardings[s] = mesh.sharding(r, input_specs[j])
    local = local_ranks(mesh)
    exchange = None
    if jax.process_count() > 1:  # each process compiles its own groups' programs only
        _compile_barrier[0] += 1  # a fresh name per compile, the same on every process
        exchange = SpecExchange(
            f"jaxpp_integration/compile_{_compile_barrier[0]}/specs", BARRIER_TIMEOUT_S
        )
    executables, slot_sharding, stats = compile_program(
        prog,
        mesh,
        input_shardings,
        cache={},
        compile_threads=opts.compile_threads,
        local_ranks=local,
        exchange=exchange,
    )
    owners = [mesh.devices_of(r)[0].process_index for r in range(mesh.mpmd_dim)]
    walk = prepare(prog, executables, slot_sharding, local, mesh.mpmd_axis_name, owners)
    if exchange is not None:  # every process compiled its part: meet before the first step
        wait_at_barrier(f"jaxpp_integration_compiled_{_compile_barrier[0]}", BARRIER_TIMEOUT_S)
    out_specs = None
    if opts.out_specs is not None:
        out_specs = [
            mesh.check_spec(s, "out_specs")
            for s in _flat_specs(
                opts.out_specs,
                jax.tree.unflatten(out_tree, [0] * out_tree.num_leaves),
                "out_specs",
            )
        ]
    return CompiledMpmdFunction(
        mesh,
        prog,
        executables,
        slot_sharding,
        in_tree,
        avals,
        specs,
        out_tree,
        out_specs,
        len(leaves),
        [np.asarray(c) for c in closed.consts],
        schedule,
        walk,
        local,
        stats,
        watchdog=_watchdog(opts.pipeline_hang_timeout_s, prog, mesh, local),
        reduction_choice=reductions.choice,
    )


def _watchdog(timeout_s, prog, mesh: MpmdMesh, local) -> Watchdog | None:
    if not timeout_s or jax.process_count() == 1:
        return None
    owner = lambda r: mesh.devices_of(r)[0].process_index  # noqa: E731
    return Watchdog(timeout_s, lambda i: describe_instruction(prog, i, local, owner))


BARRIER_TIMEOUT_S = 1800.0  # processes may compile at very different speeds
_compile_barrier = [0]


def local_ranks(mesh: MpmdMesh) -> frozenset:
    """The groups whose devices this process owns (all of them on a single host)."""
    me = jax.process_index()
    ranks = set()
    for r in range(mesh.mpmd_dim):
        owners = {d.process_index for d in mesh.devices_of(r)}
        if len(owners) > 1:
            raise ValueError(
                f"group {r} spans processes {sorted(owners)}; each group must belong to one "
                "process (order the mesh devices so every pipeline group sits on one host)"
            )
        if me in owners:
            ranks.add(r)
    return frozenset(ranks)


def _arg_index(args) -> list[int]:
    """For each flat leaf, the index of the positional argument it came from."""
    out = []
    for i, a in enumerate(args):
        out.extend([i] * len(jax.tree.leaves(a)))
    return out
