"""The files around a checkpoint's tokenizer that chat generation reads.

A converted checkpoint keeps its tokenizer folder (`tokenizer.json` or `tokenizer.model`,
`tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`: `MaxText/convert`), and
a run trained on prepared chat shards has the shards' folder (the same files, `prepare --format
chat`). `tokenizer_folder(config)` is that folder: `tokenizer_path`'s, else the one of
`grain_train_files`. `generation_eos_ids` reads `eos_token_id` (an id or a list: Llama 3 stops at
`<|eot_id|>` and `<|end_of_text|>`) from its generation_config.json. `read_prompt_messages` reads
`chat_prompt_file=`: a JSON list of messages, or an object with one under "messages".
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from MaxText.data.chat import ROLES
from MaxText.data.chat_template import ChatTemplate, find_chat_template
from MaxText.data.errors import DataError, DataNotFoundError

GENERATION_CONFIG = "generation_config.json"


def tokenizer_folder(config: Any) -> pathlib.Path:
    """The folder of the run's tokenizer (see the module doc)."""
    if config.tokenizer_path:
        path = pathlib.Path(config.tokenizer_path).expanduser()
        return path if path.is_dir() else path.parent
    if config.dataset_type == "grain" and config.grain_train_files:
        from MaxText.data.grain_pipeline import TokenShards

        return TokenShards(config.grain_train_files, "grain_train_files").folder
    raise DataError(
        "use_chat_template=true needs the checkpoint's tokenizer folder: the checkpoint names no "
        "tokenizer_path and was not trained on grain shards; give tokenizer_path="
    )


def run_template(config: Any, folder: pathlib.Path, tokenizer: Any) -> ChatTemplate:
    return find_chat_template(folder, config.chat_template, tokenizer)


def generation_eos_ids(folder: pathlib.Path) -> list[int]:
    """`eos_token_id` of the folder's generation_config.json as a list ([] without one)."""
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise DataError(f"{path} is not a JSON object ({e})") from None
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int)]


def read_prompt_messages(path_text: str) -> list[dict[str, str]]:
    """The messages of `chat_prompt_file` (see the module doc); DataError naming the file."""
    path = pathlib.Path(path_text).expanduser()
    if not path.is_file():
        raise DataNotFoundError(f"chat_prompt_file={path_text!r} is not a file")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"chat_prompt_file={path_text!r} is not valid JSON ({e})") from None
    messages = raw.get("messages") if isinstance(raw, dict) else raw
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"chat_prompt_file={path_text!r} must hold a list of messages "
            '([{"role": "user", "content": "..."}]) or {"messages": [...]}'
        )
    for k, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"chat_prompt_file={path_text!r}: message {k} needs a role ({', '.join(ROLES)}) "
                "and a string content"
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]
