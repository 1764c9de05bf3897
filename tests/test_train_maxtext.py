"""MaxText's keys at train level: opt_type and init_weights_seed against optax/flax references,
mu_dtype, hardware=gpu without a GPU, and a MaxText getting-started command run unchanged through
`train.py` (the clipped/raw gradient norms and the per-step line: tests/test_train.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compare import assert_bitwise
from small_model import SMALL_MODEL

from MaxText import sharding
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, ConfigError, load_config
from MaxText.model import Decoder, canonical_init, init_params
from MaxText.optimizer import _decay_mask, make_optimizer
from MaxText.train_step import CPU_INIT_COMPILER_OPTIONS, _init_on, state_specs

REPO = Path(__file__).resolve().parent.parent


def config_for(tmp_path, *overrides):
    return load_config(
        [
            str(CONFIGS_DIR / "base.yml"),
            *SMALL_MODEL,
            "warmup_steps_fraction=0",  # step 0 applies learning_rate itself
            "steps=3",
            "enable_checkpointing=false",
            f"base_output_directory={tmp_path}",
            *overrides,
        ]
    )


def reference_optimizer(config) -> optax.GradientTransformation:
    """What each opt_type must be, written from optax's documented constructors: clipping by
    global norm, then the optimizer on the warmup + cosine schedule (warmup 0 here)."""
    lr = optax.cosine_decay_schedule(
        config.learning_rate,
        config.learning_rate_schedule_steps,
        config.learning_rate_final_fraction,
    )
    b1, b2, eps, wd = config.adam_b1, config.adam_b2, config.adam_eps, config.adam_weight_decay
    opt = {
        "adamw": optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, mask=_decay_mask),
        "adam": optax.adam(lr, b1=b1, b2=b2, eps=eps),
        "sgd": optax.sgd(lr),
        "adafactor": optax.adafactor(lr, weight_decay_rate=wd, weight_decay_mask=_decay_mask),
    }[config.opt_type]
    return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), opt)


def _tree(rng):
    """A parameter-like tree: matrices (decayed), a norm scale and a bias (not decayed)."""
    return {
        "layers_0": {
            "mlp": {"wi": rng.normal(size=(8, 16)), "wi_bias": rng.normal(size=(16,))},
            "pre_norm": {"scale": 1 + 0.1 * rng.normal(size=(8,))},
        },
        "token_embedding": rng.normal(size=(32, 8)),
    }


def test_opt_type_is_the_optax_optimizer(tmp_path):
    """For each opt_type, three steps of `make_optimizer` equal the optax reference bitwise (same
    ops, same order), and the four optimizers give four different results (opt_type is used)."""
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _tree(rng))
    grads = [jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _tree(rng)) for _ in range(3)]

    def run(opt):
        state, p = opt.init(params), params
        for g in grads:
            updates, state = opt.update(g, state, p)
            p = optax.apply_updates(p, updates)
        return p

    results = {}
    for opt_type in ("adamw", "adam", "sgd", "adafactor"):
        config = config_for(tmp_path, f"opt_type={opt_type}", "gradient_clipping_threshold=2.0")
        results[opt_type] = run(make_optimizer(config)[0])
        assert_bitwise(run(reference_optimizer(config)), results[opt_type], what=f"{opt_type} ")
    embeddings = [np.asarray(r["token_embedding"]) for r in results.values()]
    for i in range(len(embeddings)):
        for j in range(i):
            assert not np.allclose(embeddings[i], embeddings[j])


def test_init_weights_seed_is_the_flax_init_with_that_key(tmp_path):
    """The state initialiser with init_weights_seed=7 equals the model's flax initialisation
    with key 7 (not the key of `seed`), bitwise: the reference runs `canonical_init` and
    `init_params` (the model's own init, every layer from one stacked initialisation) as two
    plain jax.jit programs compiled with the same XLA:CPU options."""
    config = config_for(tmp_path, "init_weights_seed=7")
    mesh = sharding.make_mesh(config, devices.setup(**config.device_args()))
    model = Decoder(config)
    optimizer = make_optimizer(config)[0]
    _, specs = state_specs(config, model, optimizer)
    init_state, _ = _init_on(mesh, config, model, optimizer, specs)
    got = jax.tree.map(np.asarray, init_state()["params"])

    tokens = jnp.zeros((1, config.max_target_length), jnp.int32)
    options = CPU_INIT_COMPILER_OPTIONS  # XLA:CPU's cheap RNG compile, as the trainer uses

    def reference(key):
        canonical = (
            jax.jit(lambda k: nn.unbox(canonical_init(config, k, tokens)))
            .lower(key)
            .compile(compiler_options=options)(key)
        )
        return (
            jax.jit(lambda k, c: nn.unbox(init_params(model, k, tokens, c)))
            .lower(key, canonical)
            .compile(compiler_options=options)(key, canonical)
        )

    assert_bitwise(reference(jax.random.key(7)), got, what="init ")
    seed0 = reference(jax.random.key(config.seed))
    assert not np.allclose(seed0["token_embedding"], got["token_embedding"])


def test_mu_dtype_sets_adams_first_moment(tmp_path):
    for mu_dtype, want in (("", jnp.float32), ("bfloat16", jnp.bfloat16)):
        config = config_for(tmp_path, f"mu_dtype={mu_dtype}")
        abstract, _ = state_specs(config, Decoder(config), make_optimizer(config)[0])
        adam_state = abstract["opt_state"][1][0]
        assert {x.dtype for x in jax.tree.leaves(adam_state.mu)} == {jnp.dtype(want)}
        assert {x.dtype for x in jax.tree.leaves(adam_state.nu)} == {jnp.dtype(jnp.float32)}


def test_hardware_gpu_without_a_gpu_is_one_line():
    with pytest.raises(ConfigError) as info:
        devices.setup(1, hardware="gpu")
    assert str(info.value) == (
        "hardware=gpu but JAX finds no GPU (its devices are CPU); run ./setup.sh on the GPU "
        "host (it installs jax[cuda12]), or use hardware=cpu"
    )


def test_maxtext_getting_started_command_runs_unchanged(tmp_path, capsys):
    """A MaxText getting-started command (synthetic data, base_* model keys, hardware=cpu,
    fsdp over every device, full remat, scanned layers, autoselected attention, AdamW) through
    train.py's `main` (what `python train.py` runs; in this process, whose conftest emulates 8
    CPU devices), on the 8 devices: it trains, prints MaxText's per-step line, and
    (enable_checkpointing defaults to true, as in MaxText) leaves a checkpoint."""
    from MaxText.train import main as train

    code = train(
        [
            str(CONFIGS_DIR / "base.yml"),
            "run_name=getting_started",
            f"base_output_directory={tmp_path}",
            "dataset_type=synthetic",
            "steps=2",
            "base_emb_dim=64",
            "base_num_query_heads=4",
            "base_num_kv_heads=4",
            "base_mlp_dim=128",
            "base_num_decoder_layers=2",
            "head_dim=16",
            "per_device_batch_size=1",
            "max_target_length=32",
            "hardware=cpu",
            "ici_fsdp_parallelism=-1",
            "remat_policy=full",
            "scan_layers=true",
            "attention=autoselected",
            "opt_type=adamw",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    lines = [line for line in out.out.splitlines() if line.startswith("completed step: ")]
    assert [line.split(",")[0] for line in lines] == ["completed step: 1", "completed step: 2"]
    assert "total_weights: 256, loss: " in lines[0]  # 8 devices x 1 sequence x 32 tokens
    run = tmp_path / "getting_started"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2 and records[-1]["total_weights"] == 256
    assert (run / "checkpoints" / "2").is_dir()


@pytest.mark.slow
def test_dcn_axes_over_two_processes_train_like_one_process(tmp_path):
    """dcn_data_parallelism=2 x ici_fsdp_parallelism=2 on 2 processes (the hybrid mesh: data
    across processes, fsdp inside each) trains like ici_data_parallelism=2 x ici_fsdp=2 in one
    process: the same (2, 2, 1) mesh and global batch. Not bitwise by construction: the
    gradient sum crosses processes through gloo, adding each entry's partials in another order
    (a few ulps per step). Bound 1e-5 relative on the 3 losses: how far few-ulp perturbations
    carry into them is a property of this model's trajectory, not of the CPU, and multiplying
    every initial weight by (1 +- 2^-23) (3 draws of random signs) moves them by at most 3.1e-7
    (~3 ulps of a loss of 4.2); the bound is 30 times that. The one-process run is train.py's
    `main` in this process (4 of its 8 emulated devices)."""
    from MaxText.train import main as train

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each process emulates
    common = [
        *SMALL_MODEL,
        "dataset_type=synthetic",
        "steps=3",
        "log_period=1",
        "eval_interval=0",
        "enable_checkpointing=false",
        "enable_tensorboard=false",
        "enable_progress_bar=false",
        f"base_output_directory={tmp_path}",
    ]
    launch = [sys.executable, "-m", "MaxText.launch", "--num_processes", "2", "--timeout", "600"]
    done = subprocess.run(
        [*launch, "--", "configs/base.yml", *common, "run_name=two", "dcn_data_parallelism=2",
         "ici_fsdp_parallelism=2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    one = ["run_name=one", "ici_data_parallelism=2", "ici_fsdp_parallelism=2"]
    assert train([str(CONFIGS_DIR / "base.yml"), *common, *one]) == 0
    losses = {}
    for name in ("two", "one"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(x)["loss"] for x in lines]
    assert len(losses["one"]) == 3
    np.testing.assert_allclose(losses["two"], losses["one"], rtol=1e-5, atol=0)
