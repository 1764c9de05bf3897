"""Config loading: every YAML loads, overrides and presets merge, derived values, 1-line errors."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from small_model import BASE_MODEL, ONE_STEP

from MaxText.config import (
    CONFIGS_DIR,
    Config,
    ConfigError,
    derived_fields,
    key_fields,
    load_config,
    stage_layer_counts,
)
from MaxText.config.loader import ALIASES

REPO = Path(__file__).resolve().parent.parent
BASE = str(CONFIGS_DIR / "base.yml")
PRESETS = sorted(p.stem for p in (CONFIGS_DIR / "models").glob("*.yml"))


def load(*overrides: str) -> Config:
    return load_config([BASE, *overrides])


def test_base_yml_has_exactly_the_config_keys():
    keys = set(yaml.safe_load(Path(BASE).read_text()))
    assert keys == set(key_fields()), keys ^ set(key_fields())
    assert not keys & set(derived_fields())


def test_required_presets_exist():
    assert {"tiny", "small", "llama2-7b", "gpt3-1.3b"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_applies(name):
    preset = yaml.safe_load((CONFIGS_DIR / "models" / f"{name}.yml").read_text())
    config = load(f"model_name={name}")
    assert config.model_name == name
    for key, value in preset.items():
        got = getattr(config, key)
        if isinstance(got, tuple):  # list keys (mlp_activations) are stored as tuples
            got = list(got)
        assert got == (float(value) if isinstance(got, float) else value), key


def test_every_yaml_under_configs_is_valid():
    """No YAML under configs/ holds an unknown key (presets are checked by loading them)."""
    valid = set(key_fields()) | {"base_config"} | set(ALIASES)
    for path in CONFIGS_DIR.rglob("*.yml"):
        keys = set(yaml.safe_load(path.read_text()) or {})
        assert keys <= valid, (path, keys - valid)


def test_base_defaults_are_the_tiny_cpu_run():
    c = load()
    assert (c.model_name, c.dataset_type, c.decoder_block) == ("tiny", "text", "llama")
    assert c.num_devices == 1 and c.num_stages == 1 and c.stage_layers == (4,)
    assert c.global_batch_size == c.per_device_batch_size == 4
    assert c.num_pipeline_microbatches == 1 and c.microbatch_size == 4
    assert c.enable_checkpointing and c.checkpoint_period == 100  # MaxText's default: on
    assert c.max_num_checkpoints_to_keep == 3
    assert c.metrics_file == os.path.join(c.output_dir, "metrics.jsonl")
    assert c.learning_rate_schedule_steps == c.steps
    assert c.run_name.startswith("tiny_") and c.output_dir.endswith(c.run_name)


def test_overrides_types_and_precedence():
    c = load("steps=7", "learning_rate=1e-3", "run_name=abc", "prompt=ROMEO:", "dtype=bfloat16")
    assert (c.steps, c.learning_rate, c.run_name, c.prompt, c.dtype) == (
        7,
        1e-3,
        "abc",
        "ROMEO:",
        "bfloat16",
    )
    # the command line beats the preset, the preset beats base.yml
    c = load("model_name=small", "emb_dim=64", "num_query_heads=4", "head_dim=16")
    assert (c.emb_dim, c.vocab_size, c.learning_rate) == (64, 8192, 1.0e-3)
    assert load("model_name=small", "learning_rate=0.5").learning_rate == 0.5


def test_config_is_read_only():
    c = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.steps = 3  # type: ignore[misc]


def test_pipeline_alias_and_derived_layout():
    c = load("pipeline_parallelism=4", "num_decoder_layers=7")
    assert c.ici_pipeline_parallelism == 4 and c.num_devices == 4 and c.num_stages == 4
    assert c.stage_layers == (2, 2, 2, 1)
    assert c.num_pipeline_microbatches == 8 and c.microbatch_size == 2  # -1 -> 2 x stages
    assert c.global_batch_size == 16  # per_device_batch_size (4) x 4 devices, stages included
    c = load(
        "pipeline_parallelism=2", "num_pipeline_repeats=2", "pipeline_schedule=interleaved_1f1b"
    )
    assert c.num_stages == 4 and c.stage_layers == (1, 1, 1, 1)


def test_global_batch_size_derivation():
    c = load("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
    assert c.num_devices == 8 and c.data_parallel_devices == 4 and c.global_batch_size == 32
    c = load("ici_data_parallelism=2", "global_batch_size=8", "num_pipeline_microbatches=4")
    assert (c.global_batch_size, c.microbatch_size) == (8, 2)


@pytest.mark.parametrize(
    "layers,stages,expected",
    [
        (4, 4, (1, 1, 1, 1)),
        (7, 4, (2, 2, 2, 1)),
        (6, 4, (1, 2, 2, 1)),
        (9, 4, (2, 3, 2, 2)),
        (5, 2, (3, 2)),
        (5, 3, (2, 2, 1)),
        (3, 1, (3,)),
        (10, 8, (1, 1, 1, 2, 2, 1, 1, 1)),
    ],
)
def test_stage_layer_counts(layers, stages, expected):
    got = stage_layer_counts(layers, stages)
    assert got == expected and sum(got) == layers and min(got) >= 1


# (overrides, fragment of the one-line message)
ERRORS = {
    "unknown key": (["num_decoder_layer=2"], "unknown config key 'num_decoder_layer'"),
    "bad type": (["steps=ten"], "steps='ten' (command line): expected an integer"),
    "devices not divisible": (
        ["ici_fsdp_parallelism=-1", "ici_tensor_parallelism=3"],
        "needs a multiple of 3 devices but 8 devices are available",
    ),
    "layers < stages": (
        ["pipeline_parallelism=4", "num_decoder_layers=3"],
        "num_decoder_layers=3 is less than the 4 pipeline stages",
    ),
    "microbatches": (
        ["num_pipeline_microbatches=3"],
        "global_batch_size=4 is not divisible by num_pipeline_microbatches=3",
    ),
    "maxtext key not supported": (
        ["ici_expert_parallelism=2"],
        "not supported here: ici_expert_parallelism (command line): there are no "
        "mixture-of-experts layers here",
    ),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_config_errors_in_process(case):
    overrides, fragment = ERRORS[case]
    with pytest.raises(ConfigError) as info:
        load(*overrides).resolve_devices(8)  # a -1 axis is checked once the devices are known
    message = str(info.value)
    assert fragment in message and "\n" not in message
    if case == "unknown key":
        assert "did you mean 'num_decoder_layers'?" in message


def test_more_config_errors():
    cases = [
        (["pipeline_schedule=1fb1"], "pipeline_schedule=1fb1 is not one of"),
        (["pipeline_parallelism=2", "num_pipeline_repeats=2"], "needs pipeline_schedule="),
        (["learning_rate=fast"], "expected a number"),
        (["enable_tensorboard=1"], "expected true or false"),
        (["num_query_heads=4", "num_kv_heads=3"], "must be a multiple of num_kv_heads=3"),
        (["ici_tensor_parallelism=3"], "num_query_heads=4 is not divisible by"),
        (["num_devices=4"], "derived from other keys"),
        (["model_name=tinyy"], "did you mean 'tiny'?"),
        (["steps"], "expected key=value"),
        (
            [
                "pipeline_parallelism=4",
                "pipeline_schedule=interleaved_1f1b",
                "num_pipeline_microbatches=2",
            ],
            "needs num_pipeline_microbatches=2 to be a multiple of ici_pipeline_parallelism=4",
        ),
    ]
    for overrides, fragment in cases:
        with pytest.raises(ConfigError, match=None) as info:
            load(*overrides)
        assert fragment in str(info.value), (overrides, str(info.value))


def test_yaml_with_base_config_inherits(tmp_path):
    mine = tmp_path / "mine.yml"
    mine.write_text(f"base_config: {BASE}\nsteps: 3\n")
    assert load_config([str(mine)]).steps == 3
    for folder in (tmp_path, CONFIGS_DIR / "models"):  # the hint names a file that exists
        partial = folder / "partial_for_test.yml"
        partial.write_text("steps: 3\n")
        try:
            with pytest.raises(ConfigError, match="does not set") as info:
                load_config([str(partial)])
        finally:
            partial.unlink()
        hint = str(info.value).split("add `base_config: ")[1].split("`")[0]
        assert (folder / hint).resolve() == Path(BASE).resolve(), hint
        partial.write_text(f"base_config: {hint}\nsteps: 3\n")
        try:
            assert load_config([str(partial)]).steps == 3
        finally:
            partial.unlink()


def test_yaml_syntax_errors_say_line_and_column(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(f"base_config: {BASE}\nsteps: 3\n  seed: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config([str(bad)])
    assert str(info.value) == (
        f"config file {bad}:3:7 is not valid YAML: mapping values are not allowed here"
    )


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", ".nan", "-.inf", "1e999"])
def test_numbers_must_be_finite(value, tmp_path):
    with pytest.raises(ConfigError) as info:
        load(f"learning_rate={value}")
    assert str(info.value).startswith("learning_rate=") and str(info.value).endswith(
        " (command line): must be a finite number"
    )
    mine = tmp_path / "mine.yml"
    mine.write_text(f"base_config: {BASE}\nadam_eps: {value}\n")
    with pytest.raises(ConfigError, match=f"adam_eps=.* \\({mine}\\): must be a finite number"):
        load_config([str(mine)])


def test_a_key_given_twice_must_agree():
    with pytest.raises(ConfigError) as info:
        load("model_name=tiny", "model_name=small")
    assert str(info.value) == "model_name is given twice and disagrees (tiny vs small); set it once"
    with pytest.raises(ConfigError, match=r"steps is given twice and disagrees \(1 vs 2\)"):
        load("steps=1", "steps=2")
    assert load("steps=2", "steps=2").steps == 2  # the same value twice is harmless


def test_top_k_must_be_at_least_one():
    """decode_sampling_top_k=0 used to reach jax.lax.top_k and fail with "argmax of an empty
    sequence" at the first token."""
    with pytest.raises(ConfigError) as info:
        load("decode_sampling_top_k=0")
    assert str(info.value) == "decode_sampling_top_k=0: must be >= 1"
    assert load("decode_sampling_top_k=1").decode_sampling_top_k == 1


# ------------------------------------------------- changing a config, and the devices step


def test_replace_checks_and_derives_like_a_load():
    c = load("pipeline_parallelism=2", "num_decoder_layers=5")
    d = c.replace(num_pipeline_microbatches=4, pipeline_parallelism=1)
    assert d == load(
        "num_decoder_layers=5", "num_pipeline_microbatches=4", f"run_name={c.run_name}"
    )
    assert (d.num_stages, d.stage_layers, d.microbatch_size, d.run_name) == (1, (5,), 1, c.run_name)
    assert c.num_stages == 2  # c itself is unchanged
    with pytest.raises(ConfigError, match="must be a multiple of num_kv_heads=3"):
        c.replace(num_kv_heads=3)
    with pytest.raises(ConfigError, match="'stage_layers' .* is derived from other keys"):
        c.replace(stage_layers=(4, 1))
    with pytest.raises(ConfigError, match=r"steps='ten' \(Config.replace\): expected an integer"):
        c.replace(steps="ten")


def test_replace_starts_from_the_keys_as_given():
    """Derivation runs on the keys as given, never on derived values: the parameter scale and
    gradient accumulation are applied once however often a config is replaced."""
    c = load(*BASE_MODEL, "global_parameter_scale=2", "gradient_accumulation_steps=2")
    d = c.replace(steps=3).replace(seed=1)
    assert (d.emb_dim, d.num_query_heads, d.mlp_dim) == (c.emb_dim, c.num_query_heads, c.mlp_dim)
    assert (
        (d.global_batch_size, d.num_pipeline_microbatches)
        == (8, 2)
        == (
            c.global_batch_size,
            c.num_pipeline_microbatches,
        )
    )
    assert d.num_query_heads == 8 and d.steps == 3 and d.seed == 1


def test_load_config_starts_no_backend(monkeypatch):
    """A -1 axis and a launcher's processes stay pending: loading never asks JAX for devices or
    starts jax.distributed; `resolve_devices` decides them from what the caller found."""
    import jax

    def refuse(*args, **kwargs):
        raise AssertionError("load_config touched JAX's devices")

    for name in ("devices", "device_count", "local_devices", "process_count", "process_index"):
        monkeypatch.setattr(jax, name, refuse)
    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    c = load("ici_fsdp_parallelism=-1", "num_processes=-1", "pipeline_parallelism=2")
    assert c.devices_pending and c.processes_pending and c.axes_pending
    assert (c.num_devices, c.num_stages, c.global_batch_size) == (0, 0, 0)
    with pytest.raises(AssertionError, match="resolve the devices first"):
        c.device_args()
    g = load("hardware=gpu_multiprocess")
    assert g.processes_pending and not g.axes_pending
    r = c.resolve_devices(8, coordinator_address="h:1", num_processes=2, process_id=1)
    assert not r.devices_pending and (r.num_processes, r.process_id) == (2, 1)
    assert (r.ici_fsdp_parallelism, r.num_devices, r.num_stages) == (4, 8, 2)
    assert r == load(
        "ici_fsdp_parallelism=4",
        "pipeline_parallelism=2",
        "coordinator_address=h:1",
        "num_processes=2",
        "process_id=1",
        f"run_name={c.run_name}",
    )
    with pytest.raises(ConfigError, match="only one parallelism axis may be -1"):
        load("ici_fsdp_parallelism=-1", "ici_data_parallelism=-1")


def test_no_effect_maxtext_key_is_accepted_and_dropped(tmp_path):
    c = load("override_model_config=true")
    assert not hasattr(c, "override_model_config")
    mine = tmp_path / "mine.yml"
    mine.write_text(f"base_config: {BASE}\noverride_model_config: false\n")
    assert load_config([str(mine)]).steps == c.steps


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_train_py_exits_2_with_one_line(case, tmp_path):
    overrides, fragment = ERRORS[case]
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "configs/base.yml",
            f"base_output_directory={tmp_path}",
            *overrides,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("config error: ") and fragment in lines[0]
    assert not list(tmp_path.iterdir())  # nothing written for a config error


@pytest.mark.parametrize(
    "override, message",
    [
        # a typo of a key, or the start of one: a suggestion
        (
            "num_decoder_layer=2",
            "unknown config key 'num_decoder_layer' (command line); did you "
            "mean 'num_decoder_layers'?",
        ),
        ("learning_rat=0.1", "did you mean 'learning_rate'?"),
        ("remat=full", "did you mean 'remat_policy'?"),
        # nothing close: no suggestion (was: colour -> 'vocab_size'-like guesses at cutoff 0.5)
        (
            "colour=blue",
            "unknown config key 'colour' (command line); see configs/base.yml for valid keys",
        ),
        (
            "optimizer_name=adam",
            "unknown config key 'optimizer_name' (command line); see "
            "configs/base.yml for valid keys",
        ),
        # a MaxText key this trainer does not implement: why, never a suggestion
        (
            "quantization=int8",
            "not supported here: quantization (command line): quantization "
            "(AQT/Qwix/fp8) is not implemented; use dtype=bfloat16",
        ),
        (
            "lr_schedule_type=wsd",
            "not supported here: lr_schedule_type (command line): the "
            "schedule is linear warmup then cosine decay (then 0)",
        ),
        ("dcn_expert_parallelism=2", "not supported here: dcn_expert_parallelism"),
        (
            "decoder_block=mixtral",
            "not supported here: decoder_block=mixtral: "
            "mixture-of-experts blocks are not implemented",
        ),
    ],
)
def test_hints_only_for_close_matches_and_unsupported_maxtext_keys(override, message):
    with pytest.raises(ConfigError) as info:
        load(override)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert ("did you mean" in str(info.value)) == ("did you mean" in message), str(info.value)


def test_unsupported_maxtext_keys_say_why_in_yaml_too(tmp_path):
    from MaxText.config.unsupported_keys import UNSUPPORTED

    mine = tmp_path / "mine.yml"
    mine.write_text(f"base_config: {BASE}\nenable_dropout: true\n")
    with pytest.raises(ConfigError) as info:
        load_config([str(mine)])
    assert str(info.value) == (
        f"not supported here: enable_dropout ({mine}): "
        "dropout is not implemented (training is deterministic)"
    )
    for key in UNSUPPORTED:  # every entry is a one-line reason and not one of our keys
        assert UNSUPPORTED[key] and "\n" not in UNSUPPORTED[key]
        with pytest.raises(ConfigError, match=f"^not supported here: {key} "):
            load(f"{key}=1")


def test_unreadable_checkpoint_is_a_checkpoint_error(tmp_path, capsys):
    """A checkpoint that cannot be read is not a config error: its own type and prefix (exit 2),
    a `UserError` as every error the user fixes."""
    from MaxText.errors import CheckpointError, UserError
    from MaxText.train import main

    assert issubclass(CheckpointError, UserError) and not issubclass(CheckpointError, ConfigError)
    empty = tmp_path / "empty"  # exists (a missing path is a config error, before compiling)
    empty.mkdir()
    code = main(
        [
            BASE,
            *ONE_STEP,
            f"base_output_directory={tmp_path}",
            f"load_parameters_path={empty}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == f"checkpoint error: {empty} holds no checkpoint", err


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "dualpipev"])
def test_config_accepts_exactly_the_microbatches_the_engine_accepts(schedule):
    """The config words the engine's rule (`STAGES_PER_RANK`, `Schedule.microbatch_rule`) in
    keys instead of writing it again: for every count it agrees with the schedule's `tasks`."""
    from jaxpp_integration.schedules import STAGES_PER_RANK, ScheduleError, schedule_from_name

    repeats = STAGES_PER_RANK[schedule] or 2
    for pp in (2, 3):
        for m in range(1, 9):
            try:
                schedule_from_name(schedule, pp * repeats, pp).tasks(m)
                engine = "ok"
            except ScheduleError:
                engine = "refused"
            try:
                load(
                    f"pipeline_parallelism={pp}",
                    f"pipeline_schedule={schedule}",
                    f"num_pipeline_repeats={repeats}",
                    f"num_decoder_layers={pp * repeats}",
                    f"num_pipeline_microbatches={m}",
                    f"global_batch_size={m}",
                )
                config = "ok"
            except ConfigError:
                config = "refused"
            assert config == engine, (pp, m)
