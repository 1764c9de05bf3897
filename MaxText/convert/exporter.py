"""Our checkpoint -> Hugging Face folder of its family (`python -m MaxText.to_huggingface`).

    python -m MaxText.to_huggingface configs/base.yml load_parameters_path=CKPT hf_output_path=DIR \
        [hf_output_dtype=bfloat16|float32|float16]
    python -m MaxText.to_huggingface configs/base.yml run_name=<run> hf_output_path=DIR

CKPT is any form `load_parameters_path` takes (a converted `OUT/0/items` or `OUT`, a run folder,
its checkpoints folder, one step); with `run_name=` alone the run's newest checkpoint is used. The
model keys come from the checkpoint (`MaxText/config/checkpoint_keys.py`).

Writes `config.json` and `generation_config.json` (the source's, when the checkpoint descends
from a `to_maxtext` conversion: every field kept but the ones of model keys that changed and
`torch_dtype`; else fresh ones), the tokenizer file if the config names one, and
the weights as safetensors in `hf_output_dtype` ("" = the dtype stored in the checkpoint):
`model.safetensors`, or shards of at most `hf_max_shard_mb` MB with `model.safetensors.index.json`.
Streaming: the checkpoint is read one group of tensors at a time (the embedding, then each decoder
layer, then the norm and head) and each tensor is written out before the next group is read.

`prepare(config)` makes every check first (the checkpoint's files against their checksums, its
parameters' names and shapes, the dtype, the tokenizer), reading only metadata; `write(plan,
folder)` then streams, refusing a tensor with NaN or infinite values (or one the cast overflows)
as it goes. `python -m MaxText.to_huggingface` checks the output folder before both and gives
`write` a staging folder (`output.py`), so a refusal or a failure leaves no output behind.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from MaxText.checkpoint import parameters
from MaxText.checkpoint.integrity import check_before_reading
from MaxText.checkpoint.manager import find_step_dir, saved_config
from MaxText.config import Config, ConfigError, load_config
from MaxText.config.checkpoint_keys import saved_config as saved_config_of
from MaxText.convert import hf_config, tokenizer_files
from MaxText.convert.checks import load_checked_tokenizer, require_finite
from MaxText.convert.importer import SOURCE_CONFIG, SOURCE_GENERATION_CONFIG
from MaxText.convert.layout import Tensor, tensors_for
from MaxText.convert.safetensors_io import SafetensorsWriter
from MaxText.errors import CheckpointError


def export_config(argv: Sequence[str]) -> Config:
    """The config of the checkpoint to export: `load_parameters_path`, or the run's folder."""
    config = load_config(argv)
    if not config.load_parameters_path:
        if not Path(config.output_dir).is_dir():
            raise ConfigError(
                f"give load_parameters_path=<checkpoint> or the run_name of a run in "
                f"{config.base_output_directory} ({config.output_dir} does not exist)"
            )
        config = load_config([*argv, f"load_parameters_path={config.output_dir}"])
    if not config.hf_output_path:
        raise ConfigError("to_huggingface needs hf_output_path=<folder to write>")
    hf_config.check_exportable(config)
    return config


def source_item(path: str) -> tuple[Path, int]:
    """(orbax item folder holding `params`, step) of the checkpoint at `path`."""
    location = parameters.locate(path)
    if location is not None:
        return location.item_dir, location.step
    directory, step = find_step_dir(path)
    if step is None:
        step, _ = saved_config(path)
    return directory / str(step) / "state", step


def converted_source(path: str) -> dict[str, Any]:
    """The saved config of the converted checkpoint `path` descends from: `path` itself when
    `to_maxtext` wrote it, else the checkpoint its run started from (`load_parameters_path`,
    followed back through runs started from runs); {} when there is none (trained from scratch,
    or the source checkpoint is gone: then config.json is written fresh)."""
    seen = set()
    while path and path not in seen and Path(path).exists():
        seen.add(path)
        saved = saved_config_of(path) or {}
        if SOURCE_CONFIG in saved:
            return saved
        path = saved.get("load_parameters_path", "")
    return {}


def _groups(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    """Tensors read together: one top-level sub-tree (embedding, a layer, norm, head) each."""
    groups: dict[str, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.path[0], []).append(t)
    return list(groups.values())


def _subtree(tensors: Sequence[Tensor], stored: dict) -> dict:
    tree: dict = {}
    for t in tensors:
        node, src = tree, stored
        for part in t.path[:-1]:
            node, src = node.setdefault(part, {}), src[part]
        node[t.path[-1]] = src[t.path[-1]]
    return tree


def _get(tree: Any, path: Sequence[str]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """What `prepare` checked and `write` streams: the source item and its tensors, the dtype to
    write, the tokenizer (or None) and the converted checkpoint the model descends from."""

    config: Config
    item_dir: Path
    step: int
    stored: Any
    tensors: list[Tensor]
    dtype: np.dtype
    dtype_name: str
    tokenizer: Any
    source: dict[str, Any]


def verify_source(item_dir: Path) -> None:
    """The checkpoint's files checked against their checksums before the export reads them
    (damage: one `checkpoint error:` line naming the file)."""
    location = parameters.locate(item_dir)
    if location is not None:
        parameters.verify(location)
        return
    check_before_reading(
        item_dir.parent,
        item_dir.name,
        f"export another step of the run (load_parameters_path={item_dir.parent.parent}/<step>)",
    )


def prepare(config: Config) -> ExportPlan:
    """Every check of the export, before anything is written: the checkpoint's files, its
    parameters' names and shapes, the dtype, the tokenizer (`checks.load_checked_tokenizer`)."""
    item_dir, step = source_item(config.load_parameters_path)
    verify_source(item_dir)
    try:
        stored = parameters.stored_params(item_dir)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the parameters of {item_dir}: {e}") from None
    tensors = tensors_for(config)
    for t in tensors:
        try:
            have = _get(stored, t.path)
        except KeyError:
            raise ConfigError(
                f"{item_dir} has no parameter {'/'.join(t.path)} (another model?)"
            ) from None
        if tuple(have.shape) != t.shape:
            raise ConfigError(
                f"{item_dir}: {'/'.join(t.path)} has shape {tuple(have.shape)}, the config "
                f"says {t.shape}"
            )
    stored_dtype = np.dtype(_get(stored, tensors[0].path).dtype)
    dtype_name = config.hf_output_dtype or stored_dtype.name
    if dtype_name not in hf_config.DTYPE_NAMES:
        raise ConfigError(f"the checkpoint stores {dtype_name}; set hf_output_dtype=")
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else np.dtype(dtype_name)
    tokenizer = load_checked_tokenizer(config)
    source = converted_source(config.load_parameters_path)
    return ExportPlan(config, item_dir, step, stored, tensors, dtype, dtype_name, tokenizer, source)


def write(plan: ExportPlan, folder: Path) -> list[str]:
    """Streams the weights into `folder` (every tensor checked finite as it goes), then writes
    config.json, generation_config.json and the tokenizer file; returns the weight files."""
    config, dtype = plan.config, plan.dtype
    writer = SafetensorsWriter(
        folder,
        [(t.hf_name, t.hf_shape, dtype) for t in plan.tensors],
        max_shard_bytes=int(config.hf_max_shard_mb * 1e6),
    )
    where = f"checkpoint {plan.item_dir}"
    try:
        for group in _groups(plan.tensors):
            subtree = {"params": _subtree(group, plan.stored)}
            values = parameters.read_subtree(plan.item_dir, subtree)["params"]
            for t in group:
                value = t.to_hf(_get(values, t.path))
                with np.errstate(over="ignore"):  # an overflow is refused just below
                    cast = value.astype(dtype)
                writer.write(t.hf_name, require_finite(cast, t.hf_name, where, value))
            del values
        files = writer.close()
    except BaseException:
        writer.abort()
        raise

    tokenizer, source = plan.tokenizer, plan.source
    bos = tokenizer.bos_id if tokenizer is not None and config.add_bos else -1
    eos = tokenizer.eos_id if tokenizer is not None else -1
    written = hf_config.hf_config(
        config, plan.dtype_name, bos, eos, source=source.get(SOURCE_CONFIG)
    )
    (folder / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    generation = source.get(SOURCE_GENERATION_CONFIG) or hf_config.generation_config(bos, eos)
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if config.tokenizer_path:
        name = "tokenizer.json" if config.tokenizer_type == "huggingface" else "tokenizer.model"
        tokenizer_file = Path(config.tokenizer_path)
        if tokenizer_file.is_dir():
            tokenizer_file = tokenizer_file / name
        shutil.copyfile(tokenizer_file, folder / name)
        # its tokenizer_config.json and chat template (config.json, generation_config.json: ours)
        skip = (name, "generation_config.json")
        tokenizer_files.copy_tokenizer_files(tokenizer_file.parent, folder, skip=skip)
    return files
