"""The layer block of every stage is one program: a scanned pipeline compiles the scan body once
for the forward and once for the backward, whatever the number of stages and layers
(`jaxpp_integration/compiler/blocks.py`).

Compiles are counted with JAX's own events (`jax.monitoring`: the backend-compile event, which
names the program), with the persistent compilation cache off, so every event is a real XLA
compile. Which compiled modules hold a layer scan is read off the modules themselves (a
`stablehlo.while` in the lowered text), not off the engine's names. The trainer's default keys
(scanned layers, `gradient_reduction=step`, AdamW with clipping, 1F1B) at tiny widths. Results:
`jax.jit` of the very same step, bitwise (the scanned pipeline's exactness contract,
tests/test_scanned_pipeline.py)."""

from __future__ import annotations

import contextlib
import re

import jax
import numpy as np
import pytest
from compare import assert_bitwise, assert_on_group
from small_model import SMALL_MODEL_SHAPE, merged

from MaxText import sharding
from MaxText.cluster import devices
from MaxText.cluster.compile_cache import compilation_cache
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.model import Decoder
from MaxText.optimizer import make_optimizer
from MaxText.train_step import (
    batch_shapes,
    build_trainer,
    make_train_step,
    pipelined_train_step,
    state_specs,
)

pytestmark = pytest.mark.usefixtures("no_compilation_cache")

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def real_compiles():
    """Yields the list of compiled programs: (name, whether its module holds a loop)."""
    seen: list = []
    names: list = []
    compile_lowered = jax.stages.Lowered.compile

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE:  # fun_name "jit(<program>)"
            names.append(re.sub(r"^jit\((.*)\)$", r"\1", kwargs.get("fun_name", "?")))

    def spy(self, *args, **kwargs):
        before = len(names)
        out = compile_lowered(self, *args, **kwargs)
        has_loop = "stablehlo.while" in self.as_text()
        seen.extend((name, has_loop) for name in names[before:])
        return out

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.stages.Lowered.compile = spy
    try:
        yield seen
    finally:
        jax.stages.Lowered.compile = compile_lowered
        jax.monitoring.unregister_event_duration_listener(listener)
        assert len(seen) == len(names), "an XLA compile outside Lowered.compile"


def config_of(stages: int, layers: int, *extra):
    return load_config(
        [
            str(CONFIGS_DIR / "base.yml"),
            *merged(*SMALL_MODEL_SHAPE, f"num_decoder_layers={layers}"),  # scanned: the default
            f"pipeline_parallelism={stages}",
            "num_pipeline_microbatches=8",
            "warmup_steps_fraction=0",
            *extra,
        ]
    )


def compile_step(config, cache_dir: str = ""):
    """The trainer's pipelined step compiled on abstract inputs (as the planner does); with
    `cache_dir`, written to a persistent compilation cache there (the caller's own: nothing is
    read from it that was not compiled in this module)."""
    mesh = sharding.make_mesh(config, devices.setup(**config.device_args()))
    model = Decoder(config)
    optimizer, lr = make_optimizer(config)
    abstract, specs = state_specs(config, model, optimizer)
    fn = pipelined_train_step(config, model, optimizer, lr, specs, sharding.make_mpmd_mesh(mesh))
    jax.clear_caches()
    cache = compilation_cache(cache_dir) if cache_dir else contextlib.nullcontext()
    with cache, real_compiles() as seen, sharding.axis_rules():
        compiled = fn.compile(abstract, batch_shapes(config))
    return compiled, seen


@pytest.fixture(scope="module")
def step_cache(tmp_path_factory) -> str:
    """This module's own persistent compilation cache, for the 4 stages x 8 layers step: written
    by its counted compile (empty before it, so every compile there is still a real one), read
    by the trainer of the bitwise test, which builds the same step."""
    return str(tmp_path_factory.mktemp("compile_blocks_cache"))


@pytest.fixture(scope="module")
def compiled_steps(step_cache):
    """(stages, layers) -> `compile_step(config_of(stages, layers))`, compiled once per module:
    the compile counted by the compile test is the program the after-loop test runs parts of."""
    done: dict = {}

    def get(stages: int, layers: int):
        if (stages, layers) not in done:
            cache = step_cache if (stages, layers) == (4, 8) else ""
            done[stages, layers] = compile_step(config_of(stages, layers), cache)
        return done[stages, layers]

    return get


def expected_programs(stages: int) -> list[str]:
    """The distinct programs of a uniform scanned pipeline, the same for any number of stages
    and layers (named after the first task that compiles each). Before the loop: the batch
    split on the first and last group (tokens; targets and mask). Forward: the first stage's
    embedding, the layer block, the last stage's norm, head and loss. Backward: the loss and
    head gradients, the layer block, the embedding gradient. After the loop, in two segments
    (the squared gradient norms, then the clipped AdamW update), cut into the parts groups
    share (`blocks.independent_parts`): the layer stack's part (compiled for the first group,
    loaded onto the others), the first and last groups' own parts (the embedding; the final
    norm and head) and the scalars each kind of group hands on."""
    last = stages - 1
    return sorted(
        [
            "before_loop_0",
            f"before_loop_{last}",
            "fwd_0_pre",
            "fwd_layers",
            f"fwd_{last}_post",
            f"bwd_{last}_pre",
            "bwd_layers",
            "bwd_0_post",
            "after_loop_0_0_part0",  # the layer stack's squared norms, every group
            "after_loop_0_1_part0",  # the layer stack's AdamW update, every group
            "after_loop_0_0_part1",  # the embedding's
            "after_loop_0_1_part1",
            f"after_loop_{last}_0_part1",  # the final norm's and the head's
            f"after_loop_{last}_1_part1",
            "after_loop_0_0_part2",  # scalars handed on (first, middle and last group)
            "after_loop_0_1_part2",
            "after_loop_1_1_part1",
            f"after_loop_{last}_0_part2",
        ]
    )


@pytest.mark.parametrize("stages, layers", [(4, 8), (8, 8), (4, 32)])
def test_layer_block_compiles_once_for_forward_and_once_for_backward(
    compiled_steps, stages, layers
):
    """4 or 8 stages of 2 or 8 layers: exactly two compiled modules hold a layer scan (the
    block's forward and backward), and the compiles are the same 18 distinct programs in every
    configuration; every other group's copy of a shared program is loaded, not compiled."""
    assert config_of(stages, layers).stage_layers == (layers // stages,) * stages
    compiled, seen = compiled_steps(stages, layers)
    loops = sorted(name for name, has_loop in seen if has_loop)
    assert loops == ["bwd_layers", "fwd_layers"], seen
    # besides the tasks: the middle groups' gradient accumulators, made on their devices by one
    # program (they have no before-loop task), compiled once and loaded onto the others
    assert sorted(name for name, _ in seen) == sorted(
        [*expected_programs(stages), "accumulator_fills"]
    )
    stats = compiled.compile_stats
    assert stats.compiles == len(seen) - 1 == 18 and stats.persistent_hits == 0
    assert sorted(stats.compiled) == expected_programs(stages)
    # each layer block is loaded onto the other stages' groups
    assert stats.loads >= 2 * (stages - 1)


def test_uneven_stages_compile_once_per_layer_count():
    """7 layers on 4 stages (2, 2, 2, 1): one block per distinct layer count and phase."""
    config = config_of(4, 7)
    assert sorted(set(config.stage_layers)) == [1, 2]
    _, seen = compile_step(config)
    assert sorted(name for name, has_loop in seen if has_loop) == [
        "bwd_layers",
        "bwd_layers",
        "fwd_layers",
        "fwd_layers",
    ]


def test_four_stages_step_is_bitwise_and_each_stack_on_its_group(
    compiled_steps, step_cache, tmp_path
):
    """The trainer at 4 stages x 2 layers: two steps bitwise equal to `jax.jit` of the same step
    function (parameters, both Adam moments, metrics), each stage's stacked weights and
    moments on its own group only. (The step's task programs are read from `step_cache`, where
    the compile test's 4 x 8 compile wrote them.)"""
    compiled_steps(4, 8)
    config = config_of(4, 8, f"base_output_directory={tmp_path}")  # (the others write nothing)
    with compilation_cache(step_cache):
        trainer = build_trainer(
            config, sharding.make_mesh(config, devices.setup(**config.device_args()))
        )
    reference = jax.jit(
        make_train_step(config, trainer.model, trainer.optimizer, trainer.lr_schedule)
    )
    state = trainer.init_state()
    want = jax.tree.map(np.asarray, state)
    rng = np.random.default_rng(0)
    for _ in range(2):
        b, length = config.global_batch_size, config.max_target_length
        x = rng.integers(0, config.vocab_size, (b, length + 1)).astype(np.int32)
        mask = (rng.random((b, length)) > 0.2).astype(np.float32)
        batch = {"inputs": x[:, :-1], "targets": x[:, 1:], "targets_mask": mask}
        state, metrics = trainer.train_step(state, trainer.put_batch(batch))
        want, want_metrics = reference(want, batch)
        assert_bitwise(jax.tree.map(np.asarray, want_metrics), jax.tree.map(np.asarray, metrics))
        assert_bitwise(jax.tree.map(np.asarray, want), jax.tree.map(np.asarray, state))
    stacks = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        found = re.search(r"'layers_stage_(\d)'", jax.tree_util.keystr(path))
        if found:
            assert_on_group(leaf, trainer.mpmd_mesh, (int(found.group(1)),))
            stacks += 1
    assert stacks == 3 * 9 * 4  # params, mu, nu x 9 leaves per llama layer x 4 stages


def test_parts_of_work_after_the_loop_compute_what_the_whole_task_does(compiled_steps):
    """Every after-loop task run as parts (`blocks.independent_parts`: the shared layer-stack
    update, a group's own weights, the scalars handed on) gives the very bits the task compiled
    as one program gives, on random inputs (positive, as Adam's second moment is): each part
    uses its scalars as XLA sees them used in the whole task (`blocks._same_scalar_uses`)."""
    from jaxpp_integration.compiler.blocks import ChainedExecutable
    from jaxpp_integration.compiler.program import Run
    from jaxpp_integration.compiler.task_functions import task_function

    compiled, _ = compiled_steps(4, 8)
    prog = compiled.program
    rng = np.random.default_rng(0)
    checked = set()
    for idx, ins in enumerate(prog.instrs):
        exe = compiled.executables.get(idx)
        if not isinstance(ins, Run) or not isinstance(exe, ChainedExecutable):
            continue
        if ins.code.kind != "after" or id(ins.code) in checked:
            continue
        checked.add(id(ins.code))
        args = []
        for s in ins.ins:
            aval = prog.slot_aval[s]
            if np.issubdtype(aval.dtype, np.floating):
                host = np.abs(rng.standard_normal(aval.shape)).astype(aval.dtype) * 1e-2
            else:
                host = rng.integers(0, 5, aval.shape).astype(aval.dtype)
            args.append(jax.device_put(host, compiled.slot_sharding[s]))
        whole = jax.jit(task_function(ins.code, ins.code.eqns))(*args)
        assert_bitwise(jax.tree.map(np.asarray, whole), jax.tree.map(np.asarray, exe(*args)))
    # every group's two segments
    codes = {id(i.code): i.code for i in prog.instrs if isinstance(i, Run)}
    names = {codes[c].name for c in checked}
    assert names == {f"after_loop_{r}_{k}" for r in range(4) for k in range(2)}


def test_treduce_traces_the_microbatch_function_once():
    """A pipelined model's trace is a large part of its compile: `treduce` traces the
    microbatch function once, under `jax.jit` and under `mpmd_jit_with_loop` alike (the output
    structure comes from that same trace), and the result still equals `jax.jit`'s bitwise."""
    import optax
    from engine_models import make_step, mpmd_mesh
    from test_compile_sharing import uniform_mlp

    import jaxpp_integration as jaxpp

    params, batch, loss_fn = uniform_mlp(2)
    traces = []

    def counted(p, mb):
        traces.append(1)
        return loss_fn(p, mb)

    opt = optax.sgd(0.1)
    step = make_step(counted, opt, jaxpp.Std1F1B(2))
    args = (params, opt.init(params), batch)
    want = jax.jit(step)(*args)
    assert len(traces) == 1
    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2)).compile(*args)
    assert len(traces) == 2
    assert_bitwise(want, compiled(*args))
