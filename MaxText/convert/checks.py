"""What the converters check before they write their first byte.

`load_checked_tokenizer(config)`: the tokenizer a conversion records in (`to_maxtext`) or copies
out of (`to_huggingface`) a checkpoint must exist, read as `tokenizer_type`, and fit the model: an
id at or beyond `vocab_size` has no embedding row, so such a tokenizer is not the model's. A
refusal is one `config error:` line (exit 2) and nothing is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
