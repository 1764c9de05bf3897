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
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from MaxText.checkpoint import parameters
from MaxText.checkpoint.manager import find_step_dir, saved_config
from MaxText.config import Config, ConfigError, load_config
from MaxText.config.checkpoint_keys import saved_config as saved_config_of
from MaxText.convert import hf_config
from MaxText.convert.importer import SOURCE_CONFIG, SOURCE_GENERATION_CONFIG
from MaxText.convert.layout import Tensor, tensors_for
from MaxText.convert.safetensors_io import SafetensorsWriter
from MaxText.errors import CheckpointError

log = logging.getLogger("MaxText")


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


def _tokenizer(config: Config) -> Any | None:
    if not config.tokenizer_path:
        return None
    from MaxText.data.tokenizer import load_tokenizer

    return load_tokenizer(config.tokenizer_path, config.tokenizer_type)


def export(config: Config) -> Path:
    """Writes the Hugging Face folder `config.hf_output_path` (see the module docstring)."""
    item_dir, step = source_item(config.load_parameters_path)
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

    out = Path(config.hf_output_path).expanduser().absolute()
    writer = SafetensorsWriter(
        out,
        [(t.hf_name, t.hf_shape, dtype) for t in tensors],
        max_shard_bytes=int(config.hf_max_shard_mb * 1e6),
    )
    for group in _groups(tensors):
        values = parameters.read_subtree(item_dir, {"params": _subtree(group, stored)})["params"]
        for t in group:
            writer.write(t.hf_name, t.to_hf(_get(values, t.path)).astype(dtype))
        del values
    files = writer.close()

    source = converted_source(config.load_parameters_path)
    tokenizer = _tokenizer(config)
    bos = tokenizer.bos_id if tokenizer is not None and config.add_bos else -1
    eos = tokenizer.eos_id if tokenizer is not None else -1
    written = hf_config.hf_config(config, dtype_name, bos, eos, source=source.get(SOURCE_CONFIG))
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    generation = source.get(SOURCE_GENERATION_CONFIG) or hf_config.generation_config(bos, eos)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if config.tokenizer_path:
        name = "tokenizer.json" if config.tokenizer_type == "huggingface" else "tokenizer.model"
        source = Path(config.tokenizer_path)
        if source.is_dir():
            source = source / name
        if source.resolve() != (out / name).resolve():
            shutil.copyfile(source, out / name)
    log.info(
        "wrote %s: %d tensors in %s (%s) from checkpoint step %d (%s)",
        out,
        len(tensors),
        dtype_name,
        ", ".join(files),
        step,
        item_dir,
    )
    return out
