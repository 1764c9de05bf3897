"""What the converters check before they write their first byte.

`load_checked_tokenizer(config)`: the tokenizer a conversion records in (`to_maxtext`) or copies
out of (`to_huggingface`) a checkpoint must exist, read as `tokenizer_type`, and fit the model: an
id at or beyond `vocab_size` has no embedding row, so such a tokenizer is not the model's. A
refusal is one `config error:` line (exit 2) and nothing is written.

`require_finite(array, name, where, source)`: every tensor is checked as it streams (both
directions); a NaN or an infinity refuses the conversion naming the tensor and the counts (a
diverged or damaged checkpoint trains nothing), and the partial output is removed by the writer.
When the values were finite before a cast (`source`), the cast overflowed: float16's largest
value is 65504.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from MaxText.errors import ConfigError, UserError


def load_checked_tokenizer(config: Any) -> Any | None:
    """The tokenizer `config.tokenizer_path` names (None when it names none), refused in one line
    when it is missing, unreadable, or has more ids than the model's `vocab_size`."""
    path = config.tokenizer_path
    if not path:
        return None
    if not Path(path).expanduser().exists():
        raise ConfigError(
            f"tokenizer_path={path} does not exist; give the model's tokenizer.json or "
            f"tokenizer.model"
        )
    from MaxText.data.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(path, config.tokenizer_type)
    except UserError:
        raise
    except ValueError as e:  # a file that is not a tokenizer of that type
        raise ConfigError(str(e).splitlines()[0]) from None
    if tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(
            f"tokenizer_path={path} has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{config.vocab_size}: ids from {config.vocab_size} on have no embedding, so it is not "
            f"this model's tokenizer; give the model's own"
        )
    return tokenizer


def require_finite(array: np.ndarray, name: str, where: str, source: np.ndarray | None = None):
    """`array`, refused (ConfigError naming `where` and tensor `name`) unless every value is
    finite; `source`: the values before a cast, to tell an overflow from bad weights."""
    if np.isfinite(array).all():
        return array
    nan, inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
    if source is not None and np.isfinite(source).all():
        largest = float(np.abs(source.astype(np.float32)).max())
        raise ConfigError(
            f"{where}: tensor {name} overflows {array.dtype} ({inf} values become infinite; the "
            f"largest is {largest:.4g}); choose a wider dtype (bfloat16 or float32)"
        )
    raise ConfigError(
        f"{where}: tensor {name} has {nan} NaN and {inf} infinite values (of {array.size}); the "
        f"checkpoint is damaged or comes from a diverged run, so nothing was written"
    )
