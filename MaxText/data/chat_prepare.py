"""`prepare --format chat|preference`: JSONL conversations -> grain shards with loss masks.

    python -m MaxText.data.prepare --format chat --input chats.jsonl --out DIR \
        --tokenizer_path <a checkpoint, a Hugging Face folder or a tokenizer file> \
        [--chat_template chatml|llama3|mistral|gemma|FILE.jinja] [--chat_date YYYY-MM-DD]
        [--shard_size N] [--eval_fraction F]

Each `.jsonl` line is one example (`chat.py` gives the formats, how the trained tokens are found and
the record layout). The template is the tokenizer folder's (`chat_template.py`), else the named
fallback. `--out` receives

    train-00000.array_record ...  one record per example (chat) or per pair (preference)
    eval-00000.array_record ...   the lines whose "file:line" hashes below --eval_fraction
    tokenizer.json | tokenizer.model, and tokenizer_config.json / generation_config.json when the
                                  tokenizer's folder has them
    chat_template.jinja           the template used
    manifest.json                 kind, tokenizer and template (file, sha256, origin), the fixed
                                  date `strftime_now` rendered, counts (examples, tokens, trained
                                  tokens, identical pairs skipped), splits

The trainer refuses these shards with a tokenizer or a template other than the recorded ones
(`loader.py`). A preference pair whose chosen and rejected sides render identically teaches
nothing: it is skipped and counted; a file with no usable pair is refused. Every bad line is one
`data error:` naming the file and line (exit 2).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import shutil
from collections.abc import Sequence

import numpy as np

from MaxText.cluster.output_paths import writable_dir
from MaxText.data import chat as chat_lib
from MaxText.data import chat_template as template_lib
from MaxText.data import shards as shards_lib
from MaxText.data.errors import DataError
from MaxText.data.text import Document
from MaxText.data.tokenizer import load_tokenizer, tokenizer_file, tokenizer_type_of

KINDS = ("chat", "preference")


def _input_files(spec: str) -> list[pathlib.Path]:
    files = shards_lib.input_files(spec)
    other = [f for f in files if f.suffix != ".jsonl"]
    if other:
        raise DataError(f"{other[0]}: chat and preference data are .jsonl files (one per line)")
    return files


def _records(files: Sequence[pathlib.Path], progress):
    """(where, parsed JSON) of every non-blank line."""
    for path in files:
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if progress is not None:
                    progress.update(len(line))
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    yield where, json.loads(shards_lib.utf8_text(line, where))
                except ValueError as e:
                    if isinstance(e, DataError):
                        raise
                    raise DataError(f"{where}: is not valid JSON ({e})") from None


def _example(template, tokenizer, conversation, where) -> chat_lib.Example:
    text, spans = chat_lib.trained_spans(template, conversation, where)
    example = chat_lib.tokenize_example(tokenizer, text, spans)
    if not example.mask.any():
        raise DataError(f"{where}: no token of an assistant turn survives tokenization")
    return example


def _copy_tokenizer(source: pathlib.Path, out: pathlib.Path, template) -> str:
    """Copies the tokenizer (and its tokenizer_config.json) and writes the template into `out`."""
    shutil.copyfile(source, out / source.name)
    for name in (template_lib.TOKENIZER_CONFIG, "generation_config.json"):  # EOS ids for generate
        if (source.parent / name).is_file():
            shutil.copyfile(source.parent / name, out / name)
    (out / template_lib.TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    return source.name


def _date(text: str) -> datetime.date:
    if not text:
        return datetime.date.today()
    try:
        return datetime.date.fromisoformat(text)
    except ValueError:
        raise DataError(f"--chat_date {text!r}: give a date as YYYY-MM-DD") from None


def prepare_chat(
    input_spec: str,
    out_dir: str,
    *,
    kind: str,
    tokenizer_path: str,
    chat_template: str = "",
    chat_date: str = "",
    shard_size: int = 65536,
    eval_fraction: float = 0.0,
    quiet: bool = False,
) -> dict:
    """Writes chat (`kind="chat"`) or preference shards into `out_dir`; returns the manifest."""
    assert kind in KINDS, kind
    if shard_size < 1:
        raise DataError(f"--shard_size={shard_size}: must be >= 1")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"--eval_fraction={eval_fraction}: must be in [0, 1)")
    if not tokenizer_path:
        raise DataError(
            f"--format {kind} needs --tokenizer_path (the checkpoint's tokenizer: its template "
            "and special tokens decide the trained tokens)"
        )
    date = _date(chat_date)
    out = writable_dir(out_dir, "--out")  # before reading any input
    files = _input_files(input_spec)
    source = tokenizer_file(tokenizer_path)
    tokenizer_type = tokenizer_type_of(source)
    tokenizer = load_tokenizer(str(source), tokenizer_type)
    template = template_lib.find_chat_template(source.parent, chat_template, tokenizer, date)
    written = (shards_lib.MANIFEST, source.name, template_lib.TEMPLATE_FILE)
    existing = [n for n in written if (out / n).exists()]
    if existing:
        raise DataError(f"--out {out_dir!r} already holds {existing[0]}; use a new folder")

    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32)
    writers = {s: shards_lib.Shards(out, s, shard_size, dtype) for s in ("train", "eval")}
    counts = {"examples": 0, "tokens": 0, "trained_tokens": 0, "identical_pairs_skipped": 0}
    bar = shards_lib.progress_bar(files, f"preparing {kind} data", quiet)
    for where, record in _records(files, bar):
        doc = Document(name=where, text="")
        split = "eval" if shards_lib.is_eval(doc, eval_fraction) else "train"
        if kind == "chat":
            example = _example(
                template, tokenizer, chat_lib.chat_conversation(record, where), where
            )
            examples = [example]
            writers[split].add_record(chat_lib.encode_example(example, dtype), example.tokens.size)
        else:
            chosen, rejected = chat_lib.preference_conversations(record, where)
            examples = [_example(template, tokenizer, c, where) for c in (chosen, rejected)]
            if examples[0].text == examples[1].text:
                counts["identical_pairs_skipped"] += 1
                continue
            size = sum(e.tokens.size for e in examples)
            writers[split].add_record(chat_lib.encode_pair(*examples, dtype), size)
        counts["examples"] += 1
        counts["tokens"] += sum(int(e.tokens.size) for e in examples)
        counts["trained_tokens"] += sum(int(e.mask.sum()) for e in examples)
    if bar is not None:
        bar.close()
    for w in writers.values():
        w.close()
    if not writers["train"].shards:
        what = "usable pair" if kind == "preference" else "training example"
        skipped = counts["identical_pairs_skipped"]
        why = (
            f" ({skipped} pairs skipped: chosen and rejected render identically)" if skipped else ""
        )
        raise DataError(f"--input {input_spec!r} gave no {what}{why}")

    name = _copy_tokenizer(source, out, template)
    manifest = {
        "format": shards_lib.FORMAT,
        "version": shards_lib.FORMAT_VERSION,
        "kind": kind,
        "dtype": dtype.name,
        "tokenizer": name,
        "tokenizer_type": tokenizer_type,
        "tokenizer_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "tokenizer_origin": f"file {source}",
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "chat_template": template_lib.TEMPLATE_FILE,
        "chat_template_sha256": template.sha256,
        "chat_template_origin": template.origin,
        "chat_date": date.isoformat(),
        "input": input_spec,
        "input_files": len(files),
        "eval_fraction": eval_fraction,
        **counts,
        "splits": {s: w.summary() for s, w in writers.items() if w.shards},
    }
    tmp = out / f".{shards_lib.MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / shards_lib.MANIFEST)
    return manifest
