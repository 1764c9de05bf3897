"""The tokenizer files a checkpoint carries with it, and copying them between folders.

`TOKENIZER_FILES` is the one list: the tokenizer itself (`tokenizer.json` or `tokenizer.model`),
`tokenizer_config.json` (special tokens, and the `chat_template` of many models),
`chat_template.jinja` (newer transformers write the template here instead) and
`generation_config.json` (the EOS ids chat generation stops at). `to_maxtext` copies those present
in the Hugging Face folder into `OUT/tokenizer/` and points the checkpoint's `tokenizer_path` at
the copy, so the checkpoint keeps working when the Hugging Face folder is gone;
`to_huggingface` copies them back out beside the exported weights (its own config.json and
generation_config.json are written from the checkpoint and are not replaced).
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)
FOLDER = "tokenizer"


def copy_tokenizer_files(source: Path, target: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Copies the `TOKENIZER_FILES` present in `source` (not in `skip`) into `target` (created);
    returns their names. A file already in `target` is an error: nothing is overwritten."""
    names = [n for n in TOKENIZER_FILES if (source / n).is_file() and n not in skip]
    if not names:
        return []
    target.mkdir(parents=True, exist_ok=True)
    present = [n for n in names if (target / n).exists() and not (target / n).samefile(source / n)]
    if present:
        raise FileExistsError(f"{target / present[0]} exists; write to a new folder")
    for name in names:
        if not (target / name).exists():
            shutil.copyfile(source / name, target / name)
    return names
