"""The public API: `mpmd_jit_with_loop`, and re-exports of markers, treduce, meshes, schedules.

`mpmd_jit_with_loop(fn, mpmd_mesh=...)` runs the passes in this order (one module each):
trace (`treduce.pipelined_tracing`) → cluster the loop body (`partition`) → place work outside
the loop (`placement`) → unroll, order by schedule, transfers (`program`) → deletes
(`program.add_deletes`) → compile per group (`compile`) → run (`runtime`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_integration.compiler import partition as _partition
from jaxpp_integration.compiler import placement as _placement
from jaxpp_integration.compiler import program as _program
from jaxpp_integration.compiler import reduction_plan as _reduction
from jaxpp_integration.compiler.compile import compile_program
from jaxpp_integration.compiler.reduction_plan import AutoReduction, ReductionChoice
from jaxpp_integration.compiler.render import render_program
from jaxpp_integration.frontend.array import MpmdArray
from jaxpp_integration.frontend.marker import mark_stage_end, pipeline_enter_stage, pipeline_yield
from jaxpp_integration.frontend.mesh import MpmdMesh
from jaxpp_integration.frontend.reductions import Add, Concat, Max
from jaxpp_integration.frontend.treduce import pipelined_tracing, treduce
from jaxpp_integration.jax_compat import wait_at_barrier
from jaxpp_integration.runtime.executor import execute, prepare
from jaxpp_integration.runtime.fetch import fetch
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
from jaxpp_integration.schedules.validation import check_cross_process_order
from jaxpp_integration.tools.memory import MemoryReport

__all__ = [
    "Add",
    "AutoReduction",
    "Concat",
    "DualPipeV",
    "Eager1F1B",
    "FusedTask",
    "GPipe",
    "Interleaved1F1B",
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
    local_ranks: frozenset = frozenset()
    compile_stats: Any = None  # compile.CompileStats: XLA compiles vs executables loaded
    last_memory: MemoryReport | None = None
    last_events: list | None = None
    watchdog: Watchdog | None = None
    reduction_choice: ReductionChoice | None = None  # what gradient_reduction decided
    input_transfers: dict = dataclasses.field(default_factory=dict)  # see `_place_input`

    @property
    def closed_jaxpr(self):
        """The scheduled program as printable text (task, transfer and delete lines)."""
        return render_program(self.program)

    @property
    def num_executables(self) -> int:
        return len({id(e) for e in self.executables.values()})

    def __call__(self, *args, record_times: bool = False):
        leaves, tree = jax.tree.flatten(args)
        if tree != self.in_tree:
            raise TypeError(
                f"arguments do not match the compiled pytree: expected {self.in_tree}, got {tree}; "
                "pass the same structure or call .compile() again"
            )
        for i, (x, want) in enumerate(zip(leaves, self.in_avals)):
            got = _aval_of(x)
            if got.shape != want.shape or got.dtype != want.dtype:
                raise TypeError(
                    f"argument leaf {i} is {got.dtype}{list(got.shape)} but the function was "
                    f"compiled for {want.dtype}{list(want.shape)}; call .compile() again"
                )
        values = [*leaves, *self.consts]
        inputs = {}
        for j, slots in enumerate(self.program.inputs):
            for r, s in slots.items():
                v = self._place_input(values[j], r, self.slot_sharding[s])
                if v is not None:
                    inputs[s] = v
        try:
            outs, report, events = self._execute(inputs, record_times)
        finally:
            if self.watchdog is not None:
                self.watchdog.leave()
        self.last_memory = report
        self.last_events = events if record_times else None
        arrays = [
            MpmdArray(
                self.mpmd_mesh,
                {r: a for r, a in per_rank.items() if r in self.local_ranks},
                mpmd_idxs=tuple(slots),
                aval=self.program.slot_aval[next(iter(slots.values()))],
                spec=self.slot_sharding[next(iter(slots.values()))].spec,
            )
            for per_rank, slots in zip(outs, self.program.outputs)
        ]
        if self.out_specs is not None:
            arrays = [_respec(a, spec) for a, spec in zip(arrays, self.out_specs)]
        return jax.tree.unflatten(self.out_tree, arrays)

    def _execute(self, inputs, record_times):
        return execute(
            self.program,
            self.executables,
            self.slot_sharding,
            inputs,
            record_times=record_times,
            local_ranks=self.local_ranks,
            watchdog=self.watchdog,
        )

    def _place_input(self, x, rank, sharding):
        """`x` on group `rank` with `sharding`, or None when that group is another process's.

        An `MpmdArray` that group `rank` does not hold is sent from the first group that does:
        a copy on one host, a collective between the two processes under multi-controller JAX
        (every process visits the inputs in the same order, so the collectives match)."""
        here = rank in self.local_ranks
        if not isinstance(x, MpmdArray) or rank in x.mpmd_idxs:
            return _put(x, rank, sharding) if here else None
        src = x.mpmd_idxs[0]
        src_here = src in self.local_ranks
        if src_here and here:
            return _put(x, rank, sharding)
        if not (src_here or here):
            return None
        key = (src, rank, x.spec, x.shape, x.dtype)  # its program and receive buffer, kept
        if key not in self.input_transfers:
            mesh = self.mpmd_mesh
            link = Link(mesh.sharding(src, x.spec), mesh.sharding(rank, x.spec), x.shape, x.dtype)
            self.input_transfers[key] = CrossBatch([link], src_here, mesh.mpmd_axis_name)
        got, _ = self.input_transfers[key]([x.arrays[src]] if src_here else None)
        return None if got is None else _put(got[0], rank, sharding)


def _put(x, rank, sharding):
    if isinstance(x, MpmdArray):
        arr = x.arrays.get(rank)
        if arr is not None and arr.sharding == sharding:
            return arr
        return jax.device_put(arr if arr is not None else x.first_array, sharding)
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def _respec(a: MpmdArray, spec: PartitionSpec) -> MpmdArray:
    fixed = {}
    for r, arr in a.arrays.items():
        want = NamedSharding(a.mpmd_mesh.unstack[r], spec)
        fixed[r] = arr if arr.sharding == want else jax.device_put(arr, want)
    return MpmdArray(a.mpmd_mesh, fixed, mpmd_idxs=a.mpmd_idxs, aval=a, spec=spec)


class MpmdFunction:
    """What `mpmd_jit_with_loop` returns: call it, or `.compile(*args)` ahead of time."""

    def __init__(
        self,
        fn,
        mpmd_mesh: MpmdMesh,
        in_specs=None,
        out_specs=None,
        donate_argnums=(),
        compile_threads: int = 0,
        gradient_reduction="auto",
        pipeline_hang_timeout_s: float | None = None,
        pipeline_fsdp_ag_once: bool = False,
    ):
        if not isinstance(mpmd_mesh, MpmdMesh):
            raise TypeError(f"mpmd_mesh must be an MpmdMesh, got {type(mpmd_mesh).__name__}")
        _reduction.check_mode(gradient_reduction)
        self.gradient_reduction = gradient_reduction
        if pipeline_hang_timeout_s is not None and not pipeline_hang_timeout_s >= 0:
            raise ValueError(
                f"pipeline_hang_timeout_s={pipeline_hang_timeout_s!r} must be >= 0 seconds "
                "(0 or None: no watchdog)"
            )
        self.pipeline_hang_timeout_s = pipeline_hang_timeout_s
        self.pipeline_fsdp_ag_once = bool(pipeline_fsdp_ag_once)
        self.fn = fn
        self.mpmd_mesh = mpmd_mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.donate_argnums = tuple(
            (donate_argnums,) if isinstance(donate_argnums, int) else donate_argnums
        )
        self.compile_threads = int(compile_threads)
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


def mpmd_jit_with_loop(
    fn=None,
    *,
    mpmd_mesh,
    in_specs=None,
    out_specs=None,
    donate_argnums=(),
    compile_threads=0,
    gradient_reduction="auto",
    pipeline_hang_timeout_s=None,
    pipeline_fsdp_ag_once=False,
):
    """Pipelines the single `treduce` loop of `fn` over the groups of `mpmd_mesh`.

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
    kw = dict(
        in_specs=in_specs,
        out_specs=out_specs,
        donate_argnums=donate_argnums,
        compile_threads=compile_threads,
        gradient_reduction=gradient_reduction,
        pipeline_hang_timeout_s=pipeline_hang_timeout_s,
        pipeline_fsdp_ag_once=pipeline_fsdp_ag_once,
    )
    if fn is None:
        return lambda f: MpmdFunction(f, mpmd_mesh, **kw)
    return MpmdFunction(fn, mpmd_mesh, **kw)


def _compile(f: MpmdFunction, args) -> CompiledMpmdFunction:
    mesh = f.mpmd_mesh
    leaves, in_tree = jax.tree.flatten(args)
    avals = [_aval_of(x) for x in leaves]
    specs = [mesh.check_spec(s, "in_specs") for s in _flat_specs(f.in_specs, args, "in_specs")]

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
    schedule.validate(n_mb)
    if jax.process_count() > 1:  # each pair of processes must send and receive in one order
        check_cross_process_order(
            schedule.tasks(n_mb),
            schedule.num_stages,
            schedule.split_backward,
            schedule.stage_to_rank,
            [mesh.devices_of(r)[0].process_index for r in range(mesh.mpmd_dim)],
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh.lowering_mesh():
            reductions = _reduction.plan_reductions(jaxpr, specs, mesh, f.gradient_reduction)
    loop_body, deferred = reductions.body, reductions.deferred
    body = _partition.partition_body(
        loop_body,
        loop_eqn.params["n_consts"],
        schedule.num_stages,
        schedule.split_backward,
    )
    n_consts = loop_eqn.params["n_consts"]
    top_for_body = dict(zip(loop_body.jaxpr.invars, loop_eqn.invars))
    loop_in_need: dict = {}
    for (stage, _), task in body.tasks.items():
        for v in task.invars:
            if v in top_for_body and _placement.is_var(top_for_body[v]):
                loop_in_need.setdefault(top_for_body[v], set()).add(schedule.stage_to_rank(stage))
    del n_consts
    loop_out_ranks = [schedule.stage_to_rank(stage) for stage, _ in body.output_owner]
    place = _placement.place(jaxpr, loop_out_ranks, loop_in_need, mesh.mpmd_dim)
    prog = _program.build_program(
        closed,
        place,
        body,
        schedule,
        n_mb,
        loop_eqn.params["ops"],
        loop_eqn.params["axis"],
        loop_in_need,
        deferred,
        loop_body,
        _reduction.gather_specs(jaxpr, specs) if f.pipeline_fsdp_ag_once else None,
        reductions.reduce_specs,
    )
    donated = {i for i, leaf_arg in enumerate(_arg_index(args)) if leaf_arg in f.donate_argnums}
    prog = _program.add_deletes(prog, donated)

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
        compile_threads=f.compile_threads,
        local_ranks=local,
        exchange=exchange,
    )
    owners = [mesh.devices_of(r)[0].process_index for r in range(mesh.mpmd_dim)]
    prepare(prog, slot_sharding, local, owners, mesh.mpmd_axis_name)
    if exchange is not None:  # every process compiled its part: meet before the first step
        wait_at_barrier(f"jaxpp_integration_compiled_{_compile_barrier[0]}", BARRIER_TIMEOUT_S)
    out_specs = None
    if f.out_specs is not None:
        out_specs = [
            mesh.check_spec(s, "out_specs")
            for s in _flat_specs(
                f.out_specs, jax.tree.unflatten(out_tree, [0] * out_tree.num_leaves), "out_specs"
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
        local,
        stats,
        watchdog=_watchdog(f.pipeline_hang_timeout_s, prog, mesh, local),
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
