"""Every task program of the trainer lowers for CUDA on this CPU host (#25 item 5).

The pipelined trainer (tiny, bfloat16, pipeline_parallelism=2 x ici_fsdp_parallelism=2, default
keys otherwise: scanned layers, gradient_reduction=step) is built and compiled for CPU as usual;
then each distinct program of its train step and of its evaluation step is lowered again with
`lowering_platforms=("cuda",)` (`jaxpp_integration.compiler.compile.task_programs`). Lowering is
where a construct with no CUDA lowering (a CPU-only custom call, a primitive without a GPU rule)
fails; it stops there, since XLA:CPU would compile a CUDA-lowered module without complaint.
That the check fails where it should is tested on a step calling a CPU-only primitive (`schur`).
`attention=cudnn_flash` needs the CUDA plugin to trace, so it is not lowered here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from engine_models import make_step, mpmd_mesh

import jaxpp_integration as jaxpp
from jaxpp_integration.compiler.compile import task_programs
from MaxText import sharding
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.train_step import batch_keys, build_trainer

KEYS = [
    "dtype=bfloat16",
    "pipeline_parallelism=2",
    "ici_fsdp_parallelism=2",
    "max_target_length=64",
    "attention_block_size=32",  # chunked: two key blocks per row
    "dataset_type=synthetic",
    "enable_checkpointing=false",
]
# Distinct programs, as listed on this tree (loop tasks cut at their layer scans and the work
# after the loop cut into the parts groups share, `compiler/blocks.py`): train step =
# before_loop_{0,1}; forward: fwd_0_pre (embedding), fwd_layers (both stages' layer block),
# fwd_1_post (norm, head, loss); backward: bwd_1_pre (loss and head gradients), bwd_layers,
# bwd_0_post (the glue after stage 0's block: the embedding's gradient; stage 1's backward has
# no separate piece after its block since main's fsdp merge); reduce_{0,1} (the once-per-step
# gradient sums); after the loop, in two segments (squared norms, then the AdamW update): the
# layer stack's part, shared by both groups (after_loop_0_{0,1}_part0), each group's own part
# (embedding; norm and head: after_loop_{0,1}_{0,1}_part1) and the scalars each group hands on
# (after_loop_0_{0,1}_part2, after_loop_1_0_part2; the last group's update hands on what the
# first's does); evaluation = before_loop_{0,1}, fwd_0_pre, fwd_layers, fwd_1_post and the last
# group's reduce_1.
PROGRAMS = {"train": 19, "eval": 6}


@pytest.fixture(scope="module", params=["dot_product", "chunked"])
def compiled_steps(request):
    config = load_config([str(CONFIGS_DIR / "base.yml"), *KEYS, f"attention={request.param}"])
    trainer = build_trainer(config, sharding.make_mesh(config, jax.devices()[:4]))
    shape = (config.global_batch_size, config.max_target_length)
    batch = {
        k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "targets_mask" else jnp.int32)
        for k in batch_keys(config)
    }
    with sharding.axis_rules():  # as the trainer traces its evaluation step
        evaluation = trainer.eval_step.pipelined.compile(trainer.abstract_state["params"], batch)
    return {"train": trainer.train_step, "eval": evaluation}


def programs_of(compiled) -> list:
    return task_programs(
        compiled.program, compiled.mpmd_mesh, compiled.slot_sharding, compiled.executables
    )


def lower_for_cuda(program) -> str:
    """One task program lowered for CUDA (raises where a construct has no CUDA lowering)."""
    return program.fn.trace(*program.args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("step", ["train", "eval"])
def test_every_task_program_lowers_for_cuda(compiled_steps, step):
    compiled = compiled_steps[step]
    programs = programs_of(compiled)
    assert len(programs) == PROGRAMS[step]
    stats = compiled.compile_stats  # the programs XLA:CPU compiled (or read from the cache)
    assert len(programs) == stats.compiles + stats.persistent_hits
    assert {p.rank for p in programs} == {0, 1}
    for p in programs:
        assert "func.func public @main" in lower_for_cuda(p), p.name


def test_a_cpu_only_primitive_fails_cuda_lowering():
    """The check above catches what it is for: a 2-stage engine step whose first stage calls
    `jax.lax.linalg.schur` (XLA:CPU has it through LAPACK, CUDA has no lowering) compiles and
    runs on CPU, and lowering exactly that stage's forward program for CUDA fails, naming the
    primitive; the other programs lower."""
    key = jax.random.PRNGKey(0)
    params = {"a": jax.random.normal(key, (4, 4)), "b": jax.random.normal(key, (4, 4))}

    def loss_fn(p, x):
        t, _ = jax.lax.linalg.schur(jax.lax.stop_gradient(p["a"]))
        h = jaxpp.pipeline_enter_stage(jnp.tanh(x @ (p["a"] + t)))
        return jnp.mean((h @ p["b"]) ** 2)

    optimizer = optax.sgd(0.1)
    step = make_step(loss_fn, optimizer, jaxpp.GPipe(2))
    batch = jax.random.normal(key, (4, 3, 4))  # 4 microbatches
    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2)).compile(
        params, optimizer.init(params), batch
    )
    failed = []
    for p in programs_of(compiled):
        try:
            lower_for_cuda(p)
        except NotImplementedError as e:
            assert "'schur' not found for platform cuda" in str(e), e
            failed.append((p.name, p.rank))
    assert failed == [("fwd_0", 0)]


def test_moe_block_with_ragged_dot_lowers_for_cuda():
    """The MoE block's GPU path (`moe_matmul=ragged_dot`, bfloat16), forward and gradients,
    split over expert=2 x data=2 (the dispatch and return all-to-alls in a shard_map): every
    construct lowers for CUDA, the grouped matmuls as `ragged_dot`."""
    import flax.linen as nn

    from MaxText.model import moe

    config = load_config([str(CONFIGS_DIR / "base.yml"), "decoder_block=mixtral", "num_experts=4",
                          "num_experts_per_tok=2", "emb_dim=64", "moe_mlp_dim=128",
                          "dtype=bfloat16", "moe_matmul=ragged_dot", "ici_expert_parallelism=2",
                          "ici_data_parallelism=2"])  # fmt: skip
    mesh = sharding.make_mesh(config, jax.devices()[:4])
    x = jax.ShapeDtypeStruct((8, 16, 64), jnp.bfloat16)
    block = moe.MoeBlock(config)
    params = nn.unbox(jax.eval_shape(block.init, jax.random.key(0), x)["params"])

    def loss(p, x):
        y, stats = block.apply({"params": p}, x)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(stats)

    with jax.set_mesh(mesh), sharding.axis_rules():
        lowered = jax.jit(jax.value_and_grad(loss)).trace(params, x)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "func.func public @main" in text
    assert text.count("ragged_dot") >= 3 and "all_to_all" in text
