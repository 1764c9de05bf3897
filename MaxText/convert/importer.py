"""A Hugging Face folder (any family with a format) -> a parameters-only checkpoint
(`python -m MaxText.to_maxtext`).

    python -m MaxText.to_maxtext configs/base.yml [model_name=<preset>] hf_model_path=DIR \
        base_output_directory=OUT [weight_dtype=float32|bfloat16]

`import_config(argv)` builds the config of the converted model: the model keys come from DIR's
config.json (`hf_config.model_keys`) as a layer between the YAML files and the command line; with
`model_name=` on the command line they must equal that preset's instead (one line naming the first
field that differs). A tokenizer in DIR (`tokenizer.json` -> `tokenizer_type=huggingface`, else
`tokenizer.model` -> sentencepiece) becomes `tokenizer_path` unless one is given; the folder's
tokenizer files (`tokenizer_files.py`: with tokenizer_config.json, chat_template.jinja and
generation_config.json) are copied into `OUT/tokenizer/`, which `tokenizer_path` then names.

`convert(config)` checks every tensor's presence and shape first (nothing is written for a
checkpoint that does not fit), then streams: each tensor is read from its safetensors file when
orbax writes it, put into our layout by its family's table (`layout.py`), cast to `weight_dtype`,
checked finite (a NaN or infinity refuses the conversion naming the tensor, and the partial
output is removed) and dropped, so memory holds one tensor at a time. Output: `OUT/0/items` +
`OUT/0/config` (`MaxText/checkpoint/parameters.py`, with `checksums.json`), loadable with
`load_parameters_path=OUT/0/items` (or `OUT`) into any layout. The config item also keeps the
source's `config.json` (and `generation_config.json`) as they were, which `to_huggingface` writes
back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from MaxText.checkpoint import parameters
from MaxText.checkpoint.manager import FORMAT_VERSION
from MaxText.config import ALIASES, Config, ConfigError, load_config
from MaxText.convert import hf_config, tokenizer_files
from MaxText.convert.checks import require_finite
from MaxText.convert.layout import Tensor, tensors_for
from MaxText.convert.safetensors_io import SafetensorsError, SafetensorsReader
from MaxText.model import family_of

log = logging.getLogger("MaxText")

DTYPES = {"float32": np.float32, "float16": np.float16}
# Where the config item keeps the source folder's config.json and generation_config.json.
SOURCE_CONFIG = "hf_config"
SOURCE_GENERATION_CONFIG = "hf_generation_config"
# Tensors some checkpoints carry that the model recomputes (RoPE tables): skipped.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else DTYPES[name])


def _cli_value(argv: Sequence[str], key: str) -> str | None:
    value = None
    for token in argv[1:]:
        if token.split("=", 1)[0].strip() == key and "=" in token:
            value = token.split("=", 1)[1]
    return value


def _token(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    if isinstance(value, list | tuple):  # a list key: YAML's flow sequence
        return f"{key}=[{', '.join(str(x) for x in value)}]"
    return f"{key}={value}"


def read_hf_config(folder: Path, name: str = "config.json") -> dict[str, Any]:
    """The JSON file `name` of a Hugging Face folder (one line if it is missing or damaged)."""
    path = folder / name
    if not path.is_file():
        raise ConfigError(f"hf_model_path={folder} has no config.json (not a Hugging Face folder)")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path} holds a JSON {type(raw).__name__}, not an object of fields; is it a Hugging "
            f"Face {name}?"
        )
    return raw


def tokenizer_keys(folder: Path) -> dict[str, str]:
    """tokenizer_path/tokenizer_type of the tokenizer file in `folder` (Llama 3: tokenizer.json;
    Llama 2: tokenizer.model), or {}."""
    for name, kind in (("tokenizer.json", "huggingface"), ("tokenizer.model", "sentencepiece")):
        if (folder / name).is_file():
            return {"tokenizer_type": kind, "tokenizer_path": str(folder / name)}
    return {}


def import_config(argv: Sequence[str]) -> tuple[Config, Path]:
    """(config of the converted model, the Hugging Face folder); see the module docstring."""
    if not argv:
        raise ConfigError("usage: python -m MaxText.to_maxtext configs/base.yml hf_model_path=DIR")
    folder_text = _cli_value(argv, "hf_model_path")
    if not folder_text:
        raise ConfigError("to_maxtext needs hf_model_path=<a Hugging Face model folder>")
    folder = Path(folder_text).expanduser().absolute()
    if not folder.is_dir():
        raise ConfigError(f"hf_model_path={folder_text} is not a folder")
    keys = hf_config.model_keys(read_hf_config(folder), where=str(folder / "config.json"))
    extra = {} if _cli_value(argv, "tokenizer_path") else tokenizer_keys(folder)
    layer = [_token(k, v) for k, v in extra.items()]
    preset = _cli_value(argv, "model_name")
    if preset is None:
        layer = [_token(k, v) for k, v in keys.items()] + layer
    # keys the command line sets are checked against config.json below, not given twice
    given = {ALIASES.get(k, k) for k in (t.split("=", 1)[0].strip() for t in argv[1:])}
    layer = [t for t in layer if t.split("=", 1)[0] not in given]
    config = load_config([argv[0], *layer, *argv[1:]])
    for key, value in keys.items():
        have = getattr(config, key)
        if have != value:
            field = hf_config.hf_field(key, keys["decoder_block"])
            whose = f"model_name={preset}" if preset is not None else "the command line"
            raise ConfigError(
                f"hf_model_path={folder_text}: config.json has {field}={value!r} but {whose} "
                f"sets {key}={have!r}; "
                + ("leave model_name out to take the shapes from config.json"
                   if preset is not None else f"drop {key}= from the command line")
            )  # fmt: skip
    return config, folder


def check_tensors(
    reader: SafetensorsReader, tensors: Sequence[Tensor], folder: Path, architecture: str
) -> None:
    """Every tensor present, with its shape and a float dtype; nothing else but ignorable ones."""
    for t in tensors:
        if t.hf_name not in reader:
            raise ConfigError(f"hf_model_path={folder}: tensor {t.hf_name} is missing")
        if reader.shape(t.hf_name) != t.hf_shape:
            raise ConfigError(
                f"hf_model_path={folder}: tensor {t.hf_name} has shape "
                f"{reader.shape(t.hf_name)}, config.json implies {t.hf_shape}"
            )
        if reader.dtype(t.hf_name).kind not in "fV":  # bfloat16 is kind 'V'
            raise ConfigError(
                f"hf_model_path={folder}: tensor {t.hf_name} has dtype {reader.dtype(t.hf_name)}"
            )
    known = {t.hf_name for t in tensors}
    for name in reader.names():
        if name in known or name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight":  # a tied model that also stores its head: the same values
            continue
        raise ConfigError(
            f"hf_model_path={folder}: unexpected tensor {name} (not part of a {architecture})"
        )


def _tokenizer_copy(config: Config, folder: Path, out: Path) -> Path | None:
    """Where the folder's own tokenizer goes in the checkpoint (`OUT/tokenizer/`, with the other
    `tokenizer_files.TOKENIZER_FILES`), None when the tokenizer is not the folder's."""
    source = Path(config.tokenizer_path) if config.tokenizer_path else None
    if source is None or source.parent.absolute() != folder:
        return None
    return out / tokenizer_files.FOLDER / source.name


def _nest(leaves: dict[tuple[str, ...], Any]) -> dict:
    tree: dict = {}
    for path, leaf in leaves.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = leaf
    return tree


def convert(config: Config, folder: Path) -> Path:
    """Writes `<base_output_directory>/0/items` from `folder` (see the module docstring)."""
    try:
        reader = SafetensorsReader(folder)
    except SafetensorsError as e:
        raise ConfigError(str(e)) from None
    tensors = tensors_for(config)
    check_tensors(reader, tensors, folder, family_of(config).hf.architecture)
    dtype = _dtype(config.weight_dtype)

    where = f"hf_model_path={folder}"

    def producer(t: Tensor):  # each tensor checked finite as it streams (checks.py)
        def produce():
            value = t.to_ours(reader.read(t.hf_name))
            with np.errstate(over="ignore"):  # an overflow is refused just below
                cast = value.astype(dtype)
            return require_finite(cast, t.hf_name, where, value)

        return produce

    leaves = {t.path: parameters.LazyLeaf(t.shape, dtype, producer(t)) for t in tensors}
    out = Path(config.base_output_directory).expanduser().absolute()
    tokenizer_copy = _tokenizer_copy(config, folder, out)
    if tokenizer_copy is not None:  # the checkpoint names its own copy (made after the weights)
        config = config.replace(tokenizer_path=str(tokenizer_copy))
    saved = {"format": FORMAT_VERSION, **config.to_dict(), "converted_from": str(folder)}
    saved[SOURCE_CONFIG] = read_hf_config(folder)
    if (folder / "generation_config.json").is_file():
        saved[SOURCE_GENERATION_CONFIG] = read_hf_config(folder, "generation_config.json")
    items = parameters.write(out, 0, _nest(leaves), saved)
    if tokenizer_copy is not None:
        tokenizer_files.copy_tokenizer_files(folder, tokenizer_copy.parent)
    total = sum(leaf.nbytes for leaf in leaves.values())
    log.info(
        "wrote %s: %d tensors, %.3f GB in %s; train with load_parameters_path=%s",
        items,
        len(tensors),
        total / 1e9,
        config.weight_dtype,
        items,
    )
    return items
