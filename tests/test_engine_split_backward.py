"""Split-backward and V-shaped schedules through the engine, bitwise equal to `jax.jit`, and the
engine runs exactly the task instances the simulator models, in the simulator's order.

- ZeroBubble: every stage's backward, the first and the last included, runs as a non-empty
  `bwdI_s` and a non-empty `bwdW_s` program (ZB-H1's B and W).
- DualPipeV: the V placement (stage s and 2p-1-s on group s) holds for the parameters and the
  optimizer state, checked on the devices, with and without `fuse_overlap`.
- Every built-in schedule: the program's loop task instances per group equal the simulator's
  items for the same schedule, so simulated and real programs are the same task set.
"""

from __future__ import annotations

import jax
import pytest
from compare import assert_bitwise, assert_on_group
from engine_models import clipping_sgd, make_step, mpmd_mesh, run_both, tied_mlp_setup

import jaxpp_integration as jaxpp
from jaxpp_integration.compiler.program import Run
from jaxpp_integration.schedules import Phase, Task, item_tasks
from jaxpp_integration.schedules.simulate import simulate
from jaxpp_integration.tools.measure import to_events


def engine_tasks_per_group(compiled) -> list[list[Task]]:
    """The loop task instances of the compiled program, per group, in program order."""
    prog = compiled.program
    rows: list[list[Task]] = [[] for _ in range(prog.mpmd_dim)]
    for ins in prog.instrs:
        if isinstance(ins, Run) and ins.code.kind == "loop":
            rows[ins.code.rank].append(Task(ins.code.stage, ins.microbatch, ins.code.phase))
    return rows


def simulated_tasks_per_group(schedule, n_mb) -> list[list[Task]]:
    sim = simulate(schedule, n_mb)
    rows: list[list[Task]] = [[] for _ in range(schedule.mpmd_dim)]
    for rank, item, _, _ in sim.items:
        rows[rank].extend(item_tasks(item))
    return rows


def assert_engine_runs_the_simulated_tasks(compiled, schedule, n_mb):
    engine = engine_tasks_per_group(compiled)
    assert engine == simulated_tasks_per_group(schedule, n_mb)
    scheduled = {t for row in schedule.tasks(n_mb) for item in row for t in item_tasks(item)}
    assert {t for row in engine for t in row} == scheduled


def run_bitwise(schedule, n_mb):
    params, batch, loss_fn = tied_mlp_setup(schedule.num_stages, n_mb)
    opt = clipping_sgd()
    step = make_step(loss_fn, opt, schedule)
    mesh = mpmd_mesh(schedule.mpmd_dim)
    args = (params, opt.init(params), batch)
    ref, got, losses, compiled = run_both(step, *args, mesh)
    assert_bitwise(ref, got, "final (params, opt_state, loss, grads)")
    for step_i, (ref_loss, pp_loss) in enumerate(losses):
        assert_bitwise(ref_loss, pp_loss, f"loss of step {step_i}")
    return got, compiled, mesh, args


@pytest.mark.parametrize("groups,n_mb", [(2, 4), (4, 4), (4, 8)])
def test_zero_bubble_is_bitwise_and_splits_every_stage(groups, n_mb):
    schedule = jaxpp.ZeroBubble(groups)
    _, compiled, _, args = run_bitwise(schedule, n_mb)
    codes = {
        (ins.code.stage, ins.code.phase): ins.code
        for ins in compiled.program.instrs
        if isinstance(ins, Run) and ins.code.kind == "loop"
    }
    for stage in range(groups):
        for phase in (Phase.BWD_I, Phase.BWD_W):
            assert (stage, phase) in codes, f"{phase.value}_{stage} never runs"
            assert codes[(stage, phase)].eqns, f"{phase.value}_{stage} is an empty program"
        assert (stage, Phase.BWD) not in codes
    names = str(compiled.closed_jaxpr)
    for stage in range(groups):
        assert f"task_name=bwdI_{stage}" in names and f"task_name=bwdW_{stage}" in names
    assert_engine_runs_the_simulated_tasks(compiled, schedule, n_mb)
    # ... and a measured step's timeline shows the same boxes per group as the simulated one
    compiled(*args, record_times=True)
    measured = to_events(compiled.last_events, loop_only=True)
    simulated = simulate(schedule, n_mb).events
    for group in range(groups):
        assert [ev.name for ev in measured if ev.rank == group] == [
            ev.name for ev in simulated if ev.rank == group
        ]


@pytest.mark.parametrize(
    "groups,n_mb,fuse_overlap",
    [(2, 4, False), (4, 8, False), (4, 8, True)],
    ids=["2groups_4mb", "4groups_8mb", "4groups_8mb_fuse_overlap"],
)
def test_dualpipev_is_bitwise_with_the_v_placement(groups, n_mb, fuse_overlap):
    schedule = jaxpp.DualPipeV(groups, fuse_overlap=fuse_overlap)
    (params, opt_state, _, grads), compiled, mesh, _ = run_bitwise(schedule, n_mb)
    # layer i is stage i: stages s and 2p-1-s share group s (the V)
    v_group = [s if s < groups else 2 * groups - 1 - s for s in range(2 * groups)]
    for layer, group in enumerate(v_group):
        assert_on_group(params["layers"][layer], mesh, (group,))
        assert_on_group(grads["layers"][layer], mesh, (group,))
    # the tied embedding: stage 0 and stage 2p-1 are both on group 0
    assert_on_group(params["embed"], mesh, (0,))
    # ... and so does each layer's momentum
    checked = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        key = jax.tree_util.keystr(path)
        for layer, group in enumerate(v_group):
            if key.endswith(f"['layers'][{layer}]"):
                assert_on_group(leaf, mesh, (group,))
                checked += 1
    assert checked == 2 * groups
    assert_engine_runs_the_simulated_tasks(compiled, schedule, n_mb)


BUILT_IN = [
    jaxpp.GPipe(2),
    jaxpp.Std1F1B(2),
    jaxpp.Eager1F1B(2),
    jaxpp.Interleaved1F1B(num_stages=4, mpmd_dim=2),
    jaxpp.Interleaved1F1B(num_stages=4, mpmd_dim=2, fuse_steady_state=True),
]


@pytest.mark.parametrize("schedule", BUILT_IN, ids=repr)
def test_engine_runs_the_simulated_task_set(schedule):
    """The remaining built-in schedules (ZeroBubble and DualPipeV are checked above), bitwise:
    the program's task instances per group equal the simulator's, including the last stage's
    backward, which this model (markers only between stages) leaves to the loss-gradient cut."""
    _, compiled, _, _ = run_bitwise(schedule, 4)
    assert_engine_runs_the_simulated_tasks(compiled, schedule, 4)


def test_a_step_that_returns_only_gradients_still_runs_every_task():
    """No loss among the loop outputs: the last stage's cut falls inside its forward (still a
    valid split, see partition.py), and the program keeps the simulator's task set, bitwise."""
    schedule = jaxpp.ZeroBubble(2)
    params, batch, loss_fn = tied_mlp_setup(2, 4)

    def step(params, batch):
        return jaxpp.treduce(
            lambda mb: jax.grad(loss_fn)(params, mb), batch, schedule=schedule, operation=jaxpp.Add
        )

    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2)).compile(params, batch)
    assert_bitwise(jax.jit(step)(params, batch), compiled(params, batch), "gradients")
    assert_engine_runs_the_simulated_tasks(compiled, schedule, 4)
    for ins in compiled.program.instrs:
        if isinstance(ins, Run) and ins.code.kind == "loop":
            assert ins.code.eqns, f"{ins.name} is an empty program"
