"""The trainer's configuration: one frozen, typed `Config`, loaded and validated once.

`load_config(argv)` reads `argv[0]` (a YAML file, usually `configs/base.yml`), merges the preset
`configs/models/<model_name>.yml`, then the `key=value` overrides in `argv[1:]` (the command line
wins over the preset, the preset over the base file). With `load_parameters_path=` the model keys
saved with that checkpoint come in between (command line > checkpoint > YAML; see
`checkpoint_keys.py`). Values are parsed as YAML scalars and checked
against the field's type. Unknown keys, wrong types and impossible combinations raise `ConfigError`
with one line saying what is wrong and how to fix it; `train.py` turns that into exit code 2.

Derived values (global batch, microbatch size, pipeline stage layout, ...) are computed here once,
so the rest of the trainer reads them and never re-derives them. The config is read-only afterwards.

A YAML file other than base.yml may start with `base_config: base.yml` (a path relative to itself)
to inherit every key it does not set.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from MaxText.config.checkpoint_keys import checkpoint_values
from MaxText.config.checks import (  # noqa: F401  (ATTENTION_KERNELS: re-exported)
    ATTENTION_KERNELS,
    validate_attention_and_profiler,
    validate_data,
    validate_rope,
)
from MaxText.config.maxtext_compat import MAXTEXT_ALIASES, apply_maxtext_values
from MaxText.config.mesh import DCN_KEYS, PARALLELISM_KEYS, resolve_parallelism
from MaxText.config.pipeline import REMAT_POLICIES, derive_pipeline, stage_layer_counts  # noqa: F401
from MaxText.config.unsupported_keys import UNSUPPORTED, UNSUPPORTED_DECODER_BLOCKS
from MaxText.errors import ConfigError  # re-exported: `from MaxText.config import ConfigError`

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "zero_bubble", "dualpipev")
# Alias -> canonical key. The alias is not stored; it only sets the canonical key.
ALIASES = {"pipeline_parallelism": "ici_pipeline_parallelism"}

# ---- MaxText compatibility (names MaxText users type; MaxText/config/maxtext_compat.py)
ALIASES.update(MAXTEXT_ALIASES)
MESH_AXES = ("data", "fsdp", "tensor", "pipeline")  # ici x dcn per axis -> Config.mesh_<axis>
# Keys the trainer may resolve itself by planning (MaxText/planning/auto.py) when set to "auto".
AUTO_KEYS = ("num_pipeline_microbatches",)

CHOICES: dict[str, tuple[str, ...]] = {
    "pipeline_schedule": (*PIPELINE_SCHEDULES, "auto"),
    "gradient_reduction": ("step", "microbatch"),
    "decoder_block": ("llama", "gpt"),
    "hardware": ("auto", "cpu", "gpu", "gpu_multiprocess"),
    "opt_type": ("adamw", "adam", "sgd", "adafactor"),
    "mu_dtype": ("", "float32", "bfloat16"),
    "dtype": ("float32", "bfloat16", "float16"),
    "weight_dtype": ("float32", "bfloat16", "float16"),
    "remat_policy": (*REMAT_POLICIES, "auto"),
    "dataset_type": ("text", "synthetic", "tfds", "grain"),
    "decode_sampling_strategy": ("greedy", "weighted", "topk"),
    "rope_type": ("default", "llama3.1"),
    "hf_output_dtype": ("", "bfloat16", "float32", "float16"),
}


def _derived(default: Any = None) -> Any:
    return dataclasses.field(default=default, metadata={"derived": True})


@dataclasses.dataclass(frozen=True)
class Config:
    """Every key of configs/base.yml (see the comments there), then values derived at load."""

    # run identity and outputs
    run_name: str
    base_output_directory: str
    model_name: str
    # parallelism
    ici_data_parallelism: int
    ici_fsdp_parallelism: int
    ici_tensor_parallelism: int
    ici_pipeline_parallelism: int
    pipeline_schedule: str
    num_pipeline_microbatches: int
    num_pipeline_repeats: int
    pipeline_stage_layers: str
    pipeline_stage_remat: str
    # pipeline communication
    gradient_reduction: str
    pipeline_hang_timeout_s: float
    pipeline_fsdp_ag_once: bool
    # multi-host
    coordinator_address: str
    num_processes: int
    process_id: int
    # batch and sequence
    per_device_batch_size: float
    global_batch_size: int
    max_target_length: int
    # model
    decoder_block: str
    num_decoder_layers: int
    emb_dim: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab_size: int
    logits_via_embedding: bool
    normalization_layer_epsilon: float
    rope_max_timescale: float
    rope_type: str
    rope_scaling_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_position_embeddings: int
    dtype: str
    weight_dtype: str
    remat_policy: str
    scan_layers: bool
    # optimizer
    learning_rate: float
    warmup_steps_fraction: float
    learning_rate_final_fraction: float
    learning_rate_schedule_steps: int
    adam_b1: float
    adam_b2: float
    adam_eps: float
    adam_weight_decay: float
    gradient_clipping_threshold: float
    # loop, evaluation, logging
    steps: int
    seed: int
    log_period: int
    eval_interval: int
    eval_steps: int
    enable_tensorboard: bool
    enable_progress_bar: bool
    peak_tflops_per_device: float
    # checkpoints
    enable_checkpointing: bool
    checkpoint_period: int
    async_checkpointing: bool
    max_num_checkpoints_to_keep: int
    load_parameters_path: str
    # ---- data (MaxText names; validated by `checks.validate_data`)
    dataset_type: str
    dataset_path: str
    dataset_name: str
    train_split: str
    eval_split: str
    tokenizer_path: str
    tokenizer_type: str
    add_bos: bool
    add_eos: bool
    eval_split_fraction: float
    data_shuffle_seed: int
    packing: bool
    grain_train_files: str
    grain_eval_files: str
    grain_worker_count: int
    # ---- end of data
    # generation
    prompt: str
    max_prefill_predict_length: int
    max_predict_length: int
    decode_sampling_strategy: str
    decode_sampling_temperature: float
    decode_sampling_top_k: int
    # Hugging Face checkpoints
    hf_model_path: str
    hf_output_path: str
    hf_output_dtype: str
    hf_max_shard_mb: float
    # attention kernel and profiler (MaxText's keys; validated in checks.py)
    attention: str
    attention_block_size: int
    profiler: str
    profiler_steps: int
    skip_first_n_steps_for_profiler: int
    # MaxText compatibility keys (see configs/base.yml, "MaxText keys")
    global_parameter_scale: int
    override_model_config: bool
    hardware: str
    allow_cpu_fallback: bool  # train on CPU although nvidia-smi lists GPUs (cluster/gpu_host.py)
    dcn_data_parallelism: int
    dcn_fsdp_parallelism: int
    dcn_tensor_parallelism: int
    dcn_pipeline_parallelism: int
    num_layers_per_pipeline_stage: int
    init_weights_seed: int
    opt_type: str
    mu_dtype: str
    gradient_accumulation_steps: int
    metrics_file: str
    jax_cache_dir: str
    debug_tracebacks: bool  # full tracebacks for I/O and data errors (else one line)

    # ---- derived at load (not keys; never set them in YAML or on the command line)
    num_devices: int = _derived(1)  # data x fsdp x tensor x pipeline (ici x dcn)
    data_parallel_devices: int = _derived(1)  # data x fsdp: devices the batch is split over
    mesh_data: int = _derived(1)  # mesh axis sizes: ici_<axis>_parallelism x dcn_<axis>_...
    mesh_fsdp: int = _derived(1)
    mesh_tensor: int = _derived(1)
    mesh_pipeline: int = _derived(1)  # pipeline groups
    num_stages: int = _derived(1)  # pipeline stages = pipeline groups x repeats
    stage_layers: tuple[int, ...] = _derived(())  # decoder layers in each stage
    microbatch_size: int = _derived(1)  # global_batch_size / num_pipeline_microbatches
    # "auto" keys, resolved by the trainer through the planner (MaxText/planning/auto.py); until
    # then the config holds the defaults they replace (1f1b; 2 x stages microbatches)
    schedule_auto: bool = _derived(False)
    microbatches_auto: bool = _derived(False)
    remat_auto: bool = _derived(False)  # remat_policy=auto ("full" until resolved)
    stage_remat: tuple[str, ...] = _derived(())  # remat policy of each stage
    output_dir: str = _derived("")  # base_output_directory/run_name
    config_path: str = _derived("")  # the YAML file argv[0]

    # ---- conveniences (pure functions of the fields)
    @property
    def is_pipelined(self) -> bool:
        return self.mesh_pipeline > 1

    @property
    def uses_dcn(self) -> bool:
        """A dcn_*_parallelism > 1: the mesh is a hybrid (ici within, dcn across processes)."""
        return any(getattr(self, k) > 1 for k in DCN_KEYS)

    @property
    def process_index(self) -> int:
        """This process's share of each batch (the data pipeline reads it). Pipelined runs keep
        every group on one process with its data axes inside, so each process feeds the whole
        batch to its groups; SPMD runs split the batch rows across processes."""
        return 0 if self.is_pipelined else self.process_id

    @property
    def process_count(self) -> int:
        return 1 if self.is_pipelined else self.num_processes

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.max_target_length

    @property
    def tensorboard_dir(self) -> str:
        return os.path.join(self.output_dir, "tensorboard")

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.output_dir, "checkpoints")

    def device_args(self) -> dict[str, Any]:
        """Plain keyword values for `MaxText.cluster.devices.setup` (which does not import the
        config)."""
        parallelism = " ".join(
            f"{name}={getattr(self, name)}"
            for name in (*PARALLELISM_KEYS, *DCN_KEYS)
            if getattr(self, name) > 1
        )
        return {
            "num_devices": self.num_devices,
            "num_processes": self.num_processes,
            "coordinator_address": self.coordinator_address,
            "process_id": self.process_id,
            "parallelism": parallelism or "this run",
            "hardware": self.hardware,
            "attention": self.attention,
        }

    def to_dict(self) -> dict[str, Any]:
        """Keys and derived values as plain JSON-friendly Python values."""
        out = dataclasses.asdict(self)
        out["stage_layers"] = list(self.stage_layers)
        out["stage_remat"] = list(self.stage_remat)
        return out


def key_fields() -> dict[str, dataclasses.Field]:
    """The configurable keys (every field that is not derived), by name."""
    return {f.name: f for f in dataclasses.fields(Config) if not f.metadata.get("derived")}


def derived_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config) if f.metadata.get("derived"))


# ------------------------------------------------------------------------------------ parsing


def _describe(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[kind]


def _coerce(key: str, value: Any, kind: type, source: str) -> Any:
    """Checks `value` (already YAML-parsed, or the raw text for str fields) against `kind`."""
    bad = ConfigError(f"{key}={value!r} ({source}): expected {_describe(kind)}")
    if kind is str:
        if value is None:
            return ""
        if isinstance(value, bool | int | float | str):
            return str(value)
        raise bad
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if kind is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    raise AssertionError(f"unsupported field type {kind} for {key}")


def _field_type(field: dataclasses.Field) -> type:
    annotation = field.type
    if isinstance(annotation, str):
        annotation = {"int": int, "float": float, "bool": bool, "str": str}[annotation]
    return annotation


def _suggest(key: str) -> str:
    """A hint only for a close match (a typo, or the start of a key): a far-off suggestion such
    as `hardware` -> `adam_eps` sends the user the wrong way."""
    valid = list(key_fields()) + list(ALIASES)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
    if not match and len(key) >= 4:
        match = [k for k in valid if k.startswith(key)][:2]
        match = match if len(match) == 1 else []
    return f"; did you mean '{match[0]}'?" if match else "; see configs/base.yml for valid keys"


def _canonical(key: str, source: str) -> str:
    key = ALIASES.get(key, key)
    if key in derived_fields():
        raise ConfigError(f"'{key}' ({source}) is derived from other keys and cannot be set")
    if key not in key_fields():
        if key in UNSUPPORTED:
            raise ConfigError(f"not supported here: {key} ({source}): {UNSUPPORTED[key]}")
        raise ConfigError(f"unknown config key '{key}' ({source}){_suggest(key)}")
    return key


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, tuple[Any, str]]:
    """Returns {key: (value, source)} from a YAML file, following `base_config:` first."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path in seen:
        raise ConfigError(f"config file {path} includes itself through base_config")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"config file {path} is not valid YAML: {first}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config file {path} must be a mapping of key: value")
    values: dict[str, tuple[Any, str]] = {}
    base = raw.get("base_config")
    if base:
        values.update(_read_yaml((path.parent / str(base)).resolve(), (*seen, path)))
    for key, value in raw.items():
        if key == "base_config":
            continue
        canonical = _canonical(str(key), str(path))
        values[canonical] = (value, str(path))
    return values


def _parse_overrides(tokens: Sequence[str]) -> dict[str, tuple[Any, str]]:
    values: dict[str, tuple[Any, str]] = {}
    spellings: dict[str, str] = {}
    for token in tokens:
        if "=" not in token:
            raise ConfigError(f"expected key=value on the command line, got '{token}'")
        spelled, text = token.split("=", 1)
        key = _canonical(spelled.strip(), "command line")
        kind = _field_type(key_fields()[key])
        if kind is str:
            value: Any = text  # keep the text as typed: "ROMEO:" is not a YAML mapping here
        else:
            try:
                value = yaml.safe_load(text) if text.strip() else None
            except yaml.YAMLError:
                value = text
        if key in spellings and spellings[key] != spelled.strip() and values[key][0] != value:
            raise ConfigError(
                f"{spellings[key]} and {spelled.strip()} are the same key and disagree "
                f"({values[key][0]} vs {value}); set one of them"
            )
        spellings[key] = spelled.strip()
        values[key] = (value, "command line")  # repeated key: the last one wins
    return values


def _find_preset(name: str, config_path: Path) -> Path:
    for directory in (config_path.parent / "models", CONFIGS_DIR / "models"):
        candidate = directory / f"{name}.yml"
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in (CONFIGS_DIR / "models").glob("*.yml"))
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    hint = f"did you mean '{match[0]}'?" if match else f"known: {', '.join(known)}"
    raise ConfigError(f"model_name={name}: no configs/models/{name}.yml; {hint}")


# --------------------------------------------------------------------------------- derivation


def _validate_and_derive(values: dict[str, Any], config_path: Path) -> dict[str, Any]:
    v = values
    apply_maxtext_values(v)
    if v["decoder_block"] in UNSUPPORTED_DECODER_BLOCKS:
        block = v["decoder_block"]
        raise ConfigError(
            f"not supported here: decoder_block={block}: {UNSUPPORTED_DECODER_BLOCKS[block]}"
        )
    for key, choices in CHOICES.items():
        if v[key] not in choices:
            match = difflib.get_close_matches(str(v[key]), choices, n=1, cutoff=0.75)
            hint = f"did you mean '{match[0]}'? " if match else ""
            raise ConfigError(f"{key}={v[key]} is not one of {' | '.join(choices)}; {hint}".strip())

    positive = (
        "max_target_length",
        "num_decoder_layers",
        "emb_dim",
        "num_query_heads",
        "num_kv_heads",
        "mlp_dim",
        "vocab_size",
        "log_period",
        "num_processes",
        "max_num_checkpoints_to_keep",
        "checkpoint_period",
        "gradient_accumulation_steps",
    )
    for key in positive:
        if v[key] < 1:
            raise ConfigError(f"{key}={v[key]}: must be >= 1")
    for key in ("steps", "global_batch_size", "head_dim", "process_id"):
        if v[key] < 0:
            raise ConfigError(f"{key}={v[key]}: must be >= 0")
    nonneg = ("learning_rate", "gradient_clipping_threshold", "adam_eps", "adam_weight_decay")
    for key in (*nonneg, "pipeline_hang_timeout_s"):
        if v[key] < 0:
            raise ConfigError(f"{key}={v[key]}: must be >= 0")
    for key in ("warmup_steps_fraction", "learning_rate_final_fraction", "adam_b1", "adam_b2"):
        if not 0.0 <= v[key] <= 1.0:
            raise ConfigError(f"{key}={v[key]}: must be between 0 and 1")
    if not 0.0 <= v["eval_split_fraction"] < 1.0:
        raise ConfigError(f"eval_split_fraction={v['eval_split_fraction']}: must be in [0, 1)")
    if v["hardware"] == "gpu_multiprocess" and not v["coordinator_address"]:
        from MaxText.cluster import (
            devices,  # deferred: initialises jax.distributed and the backends
        )

        v["num_processes"], v["process_id"] = devices.cluster_process(v["hardware"])
    elif v["num_processes"] > 1 and not v["coordinator_address"]:
        raise ConfigError(f"num_processes={v['num_processes']} needs coordinator_address=host:port")
    if v["process_id"] >= v["num_processes"]:
        raise ConfigError(
            f"process_id={v['process_id']} must be < num_processes={v['num_processes']}"
        )
    if v["per_device_batch_size"] <= 0:
        raise ConfigError(f"per_device_batch_size={v['per_device_batch_size']}: must be > 0")
    validate_data(v)
    validate_rope(v)
    resolve_parallelism(v, None)
    for axis in MESH_AXES:
        v[f"mesh_{axis}"] = v[f"ici_{axis}_parallelism"] * v[f"dcn_{axis}_parallelism"]
    pp = v["mesh_pipeline"]
    dp = v["mesh_data"] * v["mesh_fsdp"]
    tp = v["mesh_tensor"]
    v["num_devices"] = dp * tp * pp
    v["data_parallel_devices"] = dp
    if pp > 1 and any(v[f"dcn_{a}_parallelism"] > 1 for a in ("data", "fsdp", "tensor")):
        raise ConfigError(
            "a pipelined run keeps each pipeline group on one process, so dcn_data/fsdp/tensor_"
            "parallelism must be 1; split the processes with dcn_pipeline_parallelism instead"
        )

    # model shape
    if v["head_dim"] == 0:
        if v["emb_dim"] % v["num_query_heads"]:
            raise ConfigError(
                f"head_dim=0 means emb_dim / num_query_heads, but emb_dim={v['emb_dim']} is not "
                f"divisible by num_query_heads={v['num_query_heads']}; set head_dim explicitly"
            )
        v["head_dim"] = v["emb_dim"] // v["num_query_heads"]
    if v["num_query_heads"] % v["num_kv_heads"]:
        raise ConfigError(
            f"num_query_heads={v['num_query_heads']} must be a multiple of "
            f"num_kv_heads={v['num_kv_heads']} (grouped-query attention)"
        )
    for key in ("num_query_heads", "num_kv_heads", "mlp_dim", "vocab_size"):
        if v[key] % tp:
            raise ConfigError(
                f"{key}={v[key]} is not divisible by tensor parallelism {tp}; "
                f"tensor parallelism splits it across devices"
            )
    if v["emb_dim"] % v["mesh_fsdp"]:
        raise ConfigError(
            f"emb_dim={v['emb_dim']} is not divisible by fsdp parallelism {v['mesh_fsdp']}; "
            f"fsdp shards parameters along it"
        )

    # pipeline: schedule, stages, per-stage layers and remat, microbatches (pipeline.py)
    derive_pipeline(v, pp, dp)

    # optimizer schedule, generation
    if v["learning_rate_schedule_steps"] == -1:
        v["learning_rate_schedule_steps"] = v["steps"]
    if v["learning_rate_schedule_steps"] < 0:
        raise ConfigError(
            f"learning_rate_schedule_steps={v['learning_rate_schedule_steps']}: must be >= 0 "
            f"(or -1 for steps)"
        )
    if v["max_prefill_predict_length"] >= v["max_predict_length"]:
        raise ConfigError(
            f"max_prefill_predict_length={v['max_prefill_predict_length']} must be less than "
            f"max_predict_length={v['max_predict_length']}"
        )

    # outputs
    if not v["run_name"]:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        v["run_name"] = f"{v['model_name']}_{stamp}"
    if "/" in v["run_name"]:
        raise ConfigError(f"run_name={v['run_name']} must not contain '/'")
    v["output_dir"] = os.path.join(v["base_output_directory"], v["run_name"])
    v["metrics_file"] = v["metrics_file"] or os.path.join(v["output_dir"], "metrics.jsonl")
    v["config_path"] = str(config_path)
    if v["init_weights_seed"] == -1:
        v["init_weights_seed"] = v["seed"]
    v["mu_dtype"] = v["mu_dtype"] or v["weight_dtype"]
    return v


def load_config(argv: Sequence[str]) -> Config:
    """Builds the Config from `argv = [yaml_path, "key=value", ...]` (see the module docstring)."""
    if not argv:
        raise ConfigError("usage: train.py configs/base.yml [key=value ...]")
    config_path = Path(argv[0])
    if config_path.suffix not in (".yml", ".yaml"):
        raise ConfigError(f"the first argument must be a YAML config file, got '{argv[0]}'")
    values = _read_yaml(config_path.resolve())
    overrides = _parse_overrides(argv[1:])

    model_name = overrides.get("model_name", values.get("model_name", (None, "")))[0]
    if model_name not in (None, "", "default"):
        preset_path = _find_preset(str(model_name), config_path.resolve())
        preset = _read_yaml(preset_path)
        preset.pop("model_name", None)
        values.update(preset)
    # load_parameters_path: the checkpoint's model keys sit between the YAML files and the
    # command line (MaxText/config/checkpoint_keys.py)
    parameters_path = overrides.get("load_parameters_path", values.get("load_parameters_path"))
    if parameters_path and parameters_path[0]:
        path = str(parameters_path[0])
        if not Path(path).exists():
            raise ConfigError(f"load_parameters_path={path} does not exist")
        source = f"checkpoint {path}"
        values.update({k: (v, source) for k, v in checkpoint_values(path).items()})
    values.update(overrides)

    missing = [k for k in key_fields() if k not in values]
    if missing:
        raise ConfigError(
            f"{config_path} does not set {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; add `base_config: base.yml` to inherit defaults"
        )
    typed = {
        key: value
        if key in AUTO_KEYS and value == "auto"
        else _coerce(key, value, _field_type(key_fields()[key]), source)
        for key, (value, source) in values.items()
    }
    derived = _validate_and_derive(typed, config_path)
    validate_attention_and_profiler(derived)
    return Config(**derived)
