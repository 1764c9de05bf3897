"""The trainer's configuration: one frozen, typed `Config`, its keys' constraints, and loading.

`load_config(argv)` merges layers of values, lowest first, each a `{key: (value, where)}` dict:
  1. `argv[0]`, a YAML file (usually `configs/base.yml`), over the file its `base_config:` names
     (a path relative to itself);
  2. the preset `configs/models/<model_name>.yml`;
  3. with `load_parameters_path=`, the model keys saved with that checkpoint
     (`checkpoint_keys.py`), so a converted checkpoint alone describes its model; a `model_name`
     the user chose (on the command line or in a YAML other than configs/base.yml) must then
     agree with them (a disagreement is refused, naming both), not be silently overridden;
  4. the `key=value` tokens of `argv[1:]` (a key given twice with different values is refused).
Values are parsed as YAML scalars and checked against the field's type, then against the
constraints declared next to each field below (`key(ge=1)`, `key(choices=...)`), then against the
rules between keys (`rules.py`), which also compute the derived fields. Any failure is a
`ConfigError` with one line saying what is wrong and how to fix it (exit code 2 in `train.py`).

A config is changed only through `config.replace(**keys)`: the same checks and derivation run on
the keys as given (never on derived values), so every `Config` is valid and derived once.

Loading starts nothing (no JAX backend, no `jax.distributed`). A -1 ici axis and the processes of
a multi-process launch (`num_processes=-1`, or `hardware=gpu_multiprocess` without
`coordinator_address`) stay pending (`devices_pending`; the fields derived from them are 0) until
`resolve_devices` is given the processes and the device count, which
`MaxText.cluster.devices.start` finds.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from jaxpp_integration.schedules import SCHEDULE_NAMES
from MaxText.config.checkpoint_keys import MODEL_KEYS, checkpoint_values
from MaxText.config.maxtext_compat import MAXTEXT_ALIASES, NO_EFFECT, VALUE_ALIASES
from MaxText.config.mesh import DCN_KEYS, PARALLELISM_KEYS, fill_axes
from MaxText.config.pipeline import REMAT_POLICIES, stage_layer_counts  # noqa: F401
from MaxText.config.rules import axes_pending, derive, processes_pending
from MaxText.config.unsupported_keys import UNSUPPORTED, UNSUPPORTED_VALUES
from MaxText.errors import ConfigError  # re-exported: `from MaxText.config import ConfigError`

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
# Alias -> canonical key. The alias is not stored; it only sets the canonical key.
ALIASES = {"pipeline_parallelism": "ici_pipeline_parallelism", **MAXTEXT_ALIASES}

ATTENTION_KERNELS = ("dot_product", "autoselected", "cudnn_flash", "chunked")
DATASET_TYPES = ("text", "synthetic", "tfds", "grain")
DTYPES = ("float32", "bfloat16", "float16")
# The model families (MaxText/model/registry.py holds the same names: tests/test_families.py).
DECODER_BLOCKS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt")


def key(*, choices=None, ge=None, gt=None, le=None, lt=None, minus_one="", auto=False) -> Any:
    """A configurable key (its default lives in configs/base.yml) and its constraints: one of
    `choices`, or a number within the bounds; `minus_one`: -1 is also allowed and means this;
    `auto`: the text "auto" is also allowed (decided later by the planner)."""
    c = dict(choices=choices, ge=ge, gt=gt, le=le, lt=lt, minus_one=minus_one, auto=auto)
    return dataclasses.field(metadata=c)


def derived(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={"derived": True})


@dataclasses.dataclass(frozen=True)
class Config:
    """Every key of configs/base.yml (see the comments there), then values derived at load."""

    # run identity and outputs
    run_name: str = key()
    base_output_directory: str = key()
    model_name: str = key()
    # parallelism
    ici_data_parallelism: int = key(ge=1, minus_one="'the rest'")
    ici_fsdp_parallelism: int = key(ge=1, minus_one="'the rest'")
    ici_tensor_parallelism: int = key(ge=1, minus_one="'the rest'")
    ici_pipeline_parallelism: int = key(ge=1, minus_one="'the rest'")
    pipeline_schedule: str = key(choices=(*SCHEDULE_NAMES, "auto"))
    num_pipeline_microbatches: int = key(ge=1, minus_one="automatic", auto=True)
    num_pipeline_repeats: int = key(ge=1, minus_one="derived")
    pipeline_stage_layers: str = key()
    pipeline_stage_remat: str = key()
    # pipeline communication
    gradient_reduction: str = key(choices=("auto", "step", "microbatch"))
    pipeline_hang_timeout_s: float = key(ge=0)
    pipeline_fsdp_ag_once: bool = key()
    # multi-host
    coordinator_address: str = key()
    num_processes: int = key(ge=1, minus_one="the launcher's (srun, mpirun)")
    process_id: int = key(ge=0)
    # batch and sequence
    per_device_batch_size: float = key(gt=0)
    global_batch_size: int = key(ge=0)
    max_target_length: int = key(ge=1)
    # model
    decoder_block: str = key(choices=DECODER_BLOCKS)
    num_decoder_layers: int = key(ge=1)
    emb_dim: int = key(ge=1)
    num_query_heads: int = key(ge=1)
    num_kv_heads: int = key(ge=1)
    head_dim: int = key(ge=0)
    mlp_dim: int = key(ge=1)
    vocab_size: int = key(ge=1)
    logits_via_embedding: bool = key()
    use_qk_norm: bool = key()
    attention_bias: bool = key()
    mlp_activations: tuple[str, ...] = key()  # each one of MLP_ACTIVATIONS (rules.py)
    sliding_window_size: int = key(ge=0)
    attn_logits_soft_cap: float = key(ge=0)
    final_logits_soft_cap: float = key(ge=0)
    query_pre_attn_scalar: float = key(ge=0)
    use_post_attn_norm: bool = key()
    use_post_ffw_norm: bool = key()
    normalization_layer_epsilon: float = key()
    rope_max_timescale: float = key(gt=1)
    rope_type: str = key(choices=("default", "llama3.1"))
    rope_scaling_factor: float = key(ge=1)
    rope_low_freq_factor: float = key(gt=0)
    rope_high_freq_factor: float = key(gt=0)
    rope_original_max_position_embeddings: int = key(ge=1)
    dtype: str = key(choices=DTYPES)
    weight_dtype: str = key(choices=DTYPES)
    remat_policy: str = key(choices=(*REMAT_POLICIES, "auto"))
    scan_layers: bool = key()
    # optimizer
    learning_rate: float = key(ge=0)
    warmup_steps_fraction: float = key(ge=0, le=1)
    learning_rate_final_fraction: float = key(ge=0, le=1)
    learning_rate_schedule_steps: int = key(ge=0, minus_one="steps")
    adam_b1: float = key(ge=0, le=1)
    adam_b2: float = key(ge=0, le=1)
    adam_eps: float = key(ge=0)
    adam_weight_decay: float = key(ge=0)
    gradient_clipping_threshold: float = key(ge=0)
    # loop, evaluation, logging
    steps: int = key(ge=0)
    seed: int = key()
    log_period: int = key(ge=1)
    eval_interval: int = key()
    eval_steps: int = key()
    enable_tensorboard: bool = key()
    enable_progress_bar: bool = key()
    peak_tflops_per_device: float = key()
    # checkpoints
    enable_checkpointing: bool = key()
    checkpoint_period: int = key(ge=1)
    async_checkpointing: bool = key()
    max_num_checkpoints_to_keep: int = key(ge=1)
    load_parameters_path: str = key()
    # ---- data (MaxText names; rules between them in rules.py)
    dataset_type: str = key(choices=DATASET_TYPES)
    dataset_path: str = key()
    dataset_name: str = key()
    train_split: str = key()
    eval_split: str = key()
    tokenizer_path: str = key()
    tokenizer_type: str = key(choices=("sentencepiece", "huggingface"))
    add_bos: bool = key()
    add_eos: bool = key()
    eval_split_fraction: float = key(ge=0, lt=1)
    data_shuffle_seed: int = key()
    packing: bool = key()
    grain_train_files: str = key()
    grain_eval_files: str = key()
    grain_worker_count: int = key(ge=0)
    # ---- end of data
    # post-training (MaxText's keys; chat_template and sft_truncation are ours)
    use_sft: bool = key()
    sft_train_on_completion_only: bool = key()
    sft_truncation: str = key(choices=("right", "drop"))
    chat_template: str = key()
    use_dpo: bool = key()
    dpo_beta: float = key(gt=0)
    dpo_label_smoothing: float = key(ge=0, lt=0.5)
    # generation
    prompt: str = key()
    max_prefill_predict_length: int = key()
    max_predict_length: int = key()
    decode_sampling_strategy: str = key(choices=("greedy", "weighted", "topk"))
    decode_sampling_temperature: float = key(gt=0)
    decode_sampling_top_k: int = key(ge=1)
    use_chat_template: bool = key()
    chat_prompt_file: str = key()
    # Hugging Face checkpoints
    hf_model_path: str = key()
    hf_output_path: str = key()
    hf_overwrite: bool = key()
    hf_output_dtype: str = key(choices=("", "bfloat16", "float32", "float16"))
    hf_max_shard_mb: float = key(gt=0)
    # attention kernel and profiler (MaxText's keys)
    attention: str = key(choices=ATTENTION_KERNELS)
    attention_block_size: int = key(ge=1)
    profiler: str = key(choices=("", "xplane"))
    profiler_steps: int = key(ge=1)
    skip_first_n_steps_for_profiler: int = key(ge=0)
    # MaxText compatibility keys (see configs/base.yml, "MaxText keys")
    global_parameter_scale: int = key(ge=1)
    hardware: str = key(choices=("auto", "cpu", "gpu", "gpu_multiprocess"))
    allow_cpu_fallback: bool = key()  # train on CPU although nvidia-smi lists GPUs (gpu_host.py)
    dcn_data_parallelism: int = key(ge=1, minus_one="'the rest'")
    dcn_fsdp_parallelism: int = key(ge=1, minus_one="'the rest'")
    dcn_tensor_parallelism: int = key(ge=1, minus_one="'the rest'")
    dcn_pipeline_parallelism: int = key(ge=1, minus_one="'the rest'")
    num_layers_per_pipeline_stage: int = key(ge=0)
    init_weights_seed: int = key(ge=0, minus_one="seed")
    opt_type: str = key(choices=("adamw", "adam", "sgd", "adafactor"))
    mu_dtype: str = key(choices=("", "float32", "bfloat16"))
    gradient_accumulation_steps: int = key(ge=1)
    metrics_file: str = key()
    jax_cache_dir: str = key()
    debug_tracebacks: bool = key()  # full tracebacks for I/O and data errors (else one line)

    # ---- derived at load (not keys; never set them in YAML or on the command line). The device
    # counts and the pipeline layout stay 0 / () while `devices_pending`.
    num_devices: int = derived(0)  # data x fsdp x tensor x pipeline (ici x dcn)
    data_parallel_devices: int = derived(0)  # data x fsdp: devices the batch is split over
    mesh_data: int = derived(0)  # mesh axis sizes: ici_<axis>_parallelism x dcn_<axis>_...
    mesh_fsdp: int = derived(0)
    mesh_tensor: int = derived(0)
    mesh_pipeline: int = derived(0)  # pipeline groups
    num_stages: int = derived(0)  # pipeline stages = pipeline groups x repeats
    stage_layers: tuple[int, ...] = derived(())  # decoder layers in each stage
    microbatch_size: int = derived(0)  # global_batch_size / num_pipeline_microbatches
    # "auto" keys, resolved by the trainer through the planner (MaxText/planning/auto.py); until
    # then the config holds the defaults they replace (1f1b; 2 x stages microbatches)
    schedule_auto: bool = derived(False)
    microbatches_auto: bool = derived(False)
    remat_auto: bool = derived(False)  # remat_policy=auto ("full" until resolved)
    stage_remat: tuple[str, ...] = derived(())  # remat policy of each stage
    output_dir: str = derived("")  # base_output_directory/run_name
    config_path: str = derived("")  # the YAML file argv[0]
    # the keys as given (typed, before derivation): what `replace` changes and derives again
    given: Mapping[str, Any] = dataclasses.field(
        default_factory=dict, repr=False, compare=False, metadata={"derived": True}
    )

    # ---- changing a config
    def replace(self, **keys: Any) -> Config:
        """This config with `keys` (names and values as on the command line) changed, checked
        and derived again like a loaded one."""
        given = dict(self.given)
        for name, value in keys.items():
            name = _canonical(name, "Config.replace")
            given[name] = _coerce(name, value, "Config.replace")
        return _build(given, self.config_path)

    def resolve_devices(self, device_count: int | None = None, **processes: Any) -> Config:
        """The config with its pending device keys decided: `processes` (coordinator_address,
        num_processes, process_id: what the launcher says) first, then a -1 ici axis from the
        `device_count` JAX sees (all processes). Unchanged when nothing is pending."""
        config = self.replace(**processes) if processes else self
        assert not config.processes_pending, "resolve_devices needs the launcher's processes"
        if config.axes_pending:
            assert device_count is not None, "a -1 ici axis needs the device count"
            dcn = math.prod(getattr(config, k) for k in DCN_KEYS)
            values = {k: getattr(config, k) for k in PARALLELISM_KEYS}
            config = config.replace(**fill_axes(values, device_count // dcn, "devices"))
        return config

    # ---- conveniences (pure functions of the fields)
    @property
    def processes_pending(self) -> bool:
        return processes_pending(vars(self))  # see rules.py

    @property
    def axes_pending(self) -> bool:
        return axes_pending(vars(self))

    @property
    def devices_pending(self) -> bool:
        return self.processes_pending or self.axes_pending

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
        """Plain keyword values for `MaxText.cluster.devices.setup`."""
        assert not self.devices_pending, "resolve the devices first (devices.start)"
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
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["given"]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


KEYS = {f.name: f for f in dataclasses.fields(Config) if not f.metadata.get("derived")}
DERIVED = tuple(f.name for f in dataclasses.fields(Config) if f.metadata.get("derived"))
TYPES: dict[str, type] = typing.get_type_hints(Config)
CHOICES = {name: f.metadata["choices"] for name, f in KEYS.items() if f.metadata["choices"]}


def key_fields() -> dict[str, dataclasses.Field]:
    """The configurable keys (every field that is not derived), by name."""
    return dict(KEYS)


def derived_fields() -> tuple[str, ...]:
    return DERIVED


# ------------------------------------------------------------------------- one key at a time

STRINGS = tuple[str, ...]  # a list key (YAML `[a, b]`, or `a,b` on the command line)
_KIND = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    STRINGS: "a list of strings",
}


def _coerce(name: str, value: Any, source: str) -> Any:
    """`value` (YAML-parsed, or the raw text for str fields) as the field's type."""
    kind = TYPES[name]
    if KEYS[name].metadata["auto"] and value == "auto":
        return value
    if kind is str and (value is None or isinstance(value, bool | int | float | str)):
        return "" if value is None else str(value)
    if kind is float and isinstance(value, int | float | str) and not isinstance(value, bool):
        try:  # PyYAML reads "1e-3" (no dot) as a string
            number = float(value)
        except ValueError:
            number = None
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{name}={value} ({source}): must be a finite number")
            return number
    if kind in (int, bool) and type(value) is kind:  # True is not an integer here
        return value
    if kind == STRINGS and isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if (
        kind == STRINGS
        and isinstance(value, list | tuple)
        and all(isinstance(x, str) for x in value)
    ):
        return tuple(value)
    raise ConfigError(f"{name}={value!r} ({source}): expected {_KIND[kind]}")


def _checked(name: str, value: Any, c: Mapping[str, Any]) -> Any:
    """`value` after MaxText's value aliases, checked against the field's constraints."""
    value = VALUE_ALIASES.get(name, {}).get(value, value)
    if value in UNSUPPORTED_VALUES.get(name, {}):
        raise ConfigError(f"not supported here: {name}={value}: {UNSUPPORTED_VALUES[name][value]}")
    if (c["auto"] and value == "auto") or (c["minus_one"] and value == -1):
        return value
    if c["choices"] is not None and value not in c["choices"]:
        match = difflib.get_close_matches(str(value), c["choices"], n=1, cutoff=0.6)
        hint = f"; did you mean '{match[0]}'?" if match else ""
        shown = " | ".join(x or "''" for x in c["choices"])
        raise ConfigError(f"{name}={value} is not one of {shown}{hint}")
    ge, gt, le, lt = c["ge"], c["gt"], c["le"], c["lt"]
    low = (ge is None or value >= ge) and (gt is None or value > gt)
    if not (low and (le is None or value <= le) and (lt is None or value < lt)):
        rule = f">= {ge}" if gt is None else f"> {gt}"
        if le is not None or lt is not None:
            rule = f"between {ge} and {le}" if le is not None else f"in [{ge}, {lt})"
        or_minus_one = f" (or -1 for {c['minus_one']})" if c["minus_one"] else ""
        raise ConfigError(f"{name}={value}: must be {rule}{or_minus_one}")
    return value


def _build(given: dict[str, Any], config_path: str) -> Config:
    """The Config of `given` (every key, typed): each key's constraints, then the rules between
    keys and the derived values (`rules.derive`)."""
    values = {name: _checked(name, given[name], f.metadata) for name, f in KEYS.items()}
    values["config_path"] = config_path
    derive(values)
    return Config(**values, given=MappingProxyType(given))


# ------------------------------------------------------------------------------------ loading


def _suggest(name: str) -> str:
    """A hint only for a close match (a typo, or the start of a key): a far-off suggestion such
    as `hardware` -> `adam_eps` sends the user the wrong way."""
    valid = list(KEYS) + list(ALIASES)
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.75)
    if not match and len(name) >= 4:
        match = [k for k in valid if k.startswith(name)][:2]
        match = match if len(match) == 1 else []
    return f"; did you mean '{match[0]}'?" if match else "; see configs/base.yml for valid keys"


def _canonical(name: str, source: str) -> str:
    name = ALIASES.get(name, name)
    if name in DERIVED:
        raise ConfigError(f"'{name}' ({source}) is derived from other keys and cannot be set")
    if name not in KEYS:
        if name in UNSUPPORTED:
            raise ConfigError(f"not supported here: {name} ({source}): {UNSUPPORTED[name]}")
        raise ConfigError(f"unknown config key '{name}' ({source}){_suggest(name)}")
    return name


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, tuple[Any, str]]:
    """{key: (value, source)} from a YAML file, over the file its `base_config:` names."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path in seen:
        raise ConfigError(f"config file {path} includes itself through base_config")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {where} is not valid YAML: {what}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config file {path} must be a mapping of key: value")
    values: dict[str, tuple[Any, str]] = {}
    if raw.get("base_config"):
        values.update(_read_yaml((path.parent / str(raw["base_config"])).resolve(), (*seen, path)))
    for name, value in raw.items():
        if name != "base_config" and name not in NO_EFFECT:
            values[_canonical(str(name), str(path))] = (value, str(path))
    return values


def _parse_overrides(tokens: Sequence[str]) -> dict[str, tuple[Any, str]]:
    values: dict[str, tuple[Any, str]] = {}
    spellings: dict[str, str] = {}
    for token in tokens:
        if "=" not in token:
            raise ConfigError(f"expected key=value on the command line, got '{token}'")
        spelled, text = (part.strip() for part in token.split("=", 1))
        if spelled in NO_EFFECT:
            continue
        name = _canonical(spelled, "command line")
        value: Any = text  # str keys keep the text as typed: "ROMEO:" is not a YAML mapping
        if TYPES[name] is not str:
            try:
                value = yaml.safe_load(text) if text else None
            except yaml.YAMLError:
                pass
        if name in values and values[name][0] != value:
            what = f"{spelled} is given twice and disagrees"
            if spellings[name] != spelled:
                what = f"{spellings[name]} and {spelled} are the same key and disagree"
            raise ConfigError(f"{what} ({values[name][0]} vs {value}); set it once")
        spellings[name] = spelled
        values[name] = (value, "command line")
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


def _check_preset(
    named: tuple[Any, str],
    below: Mapping[str, tuple[Any, str]],
    saved: Mapping[str, Any],
    command_line: Mapping[str, tuple[Any, str]],
    path: str,
) -> None:
    """A `model_name` the user chose (command line or own YAML) must describe the model the
    checkpoint at `path` holds: the first model key the checkpoint and the preset (with the YAML
    below it) set differently is refused, unless the command line sets that key itself."""
    name, where = named
    for key in MODEL_KEYS:
        if key not in saved or key not in below or key in command_line:
            continue
        have = _checked(key, _coerce(key, saved[key], f"checkpoint {path}"), KEYS[key].metadata)
        want = _checked(key, _coerce(key, *below[key]), KEYS[key].metadata)
        if have != want:
            source = "on the command line" if where == "command line" else f"in {where}"
            raise ConfigError(
                f"model_name={name} ({source}) sets {key}={want!r} but load_parameters_path="
                f"{path} holds a model with {key}={have!r}; leave model_name out to take the "
                f"model from the checkpoint"
            )


def load_config(argv: Sequence[str]) -> Config:
    """Builds the Config from `argv = [yaml_path, "key=value", ...]` (see the module docstring)."""
    if not argv:
        raise ConfigError("usage: train.py configs/base.yml [key=value ...]")
    config_path = Path(argv[0]).resolve()
    if config_path.suffix not in (".yml", ".yaml"):
        raise ConfigError(f"the first argument must be a YAML config file, got '{argv[0]}'")
    layers = [_read_yaml(config_path)]  # 1. the YAML file over its base_config
    command_line = _parse_overrides(argv[1:])
    model_name = command_line.get("model_name", layers[0].get("model_name", (None, "")))[0]
    if model_name not in (None, "", "default"):  # 2. the model preset
        preset = _read_yaml(_find_preset(str(model_name), config_path))
        preset.pop("model_name", None)
        layers.append(preset)
    below = {name: value for layer in layers for name, value in layer.items()}
    parameters = command_line.get("load_parameters_path", below.get("load_parameters_path"))
    if parameters and parameters[0]:  # 3. the checkpoint's model keys
        path = str(parameters[0])
        if not Path(path).exists():
            raise ConfigError(f"load_parameters_path={path} does not exist")
        saved = checkpoint_values(path)
        named = command_line.get("model_name", layers[0].get("model_name"))
        if named is not None and named[1] != str(CONFIGS_DIR / "base.yml"):
            _check_preset(named, below, saved, command_line, path)
        layers.append({k: (v, f"checkpoint {path}") for k, v in saved.items()})
    layers.append(command_line)  # 4. the command line
    values = {name: value for layer in layers for name, value in layer.items()}

    missing = [name for name in KEYS if name not in values]
    if missing:
        base = os.path.relpath(CONFIGS_DIR / "base.yml", config_path.parent)
        base = str(CONFIGS_DIR / "base.yml") if base.startswith("..") else base
        raise ConfigError(
            f"{argv[0]} does not set {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            f"; add `base_config: {base}` to inherit the defaults"
        )
    given = {name: _coerce(name, value, source) for name, (value, source) in values.items()}
    if not given["run_name"]:  # decided once: `replace` keeps it
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        given["run_name"] = f"{given['model_name']}_{stamp}"
    return _build(given, str(config_path))
