"""Prepares a text corpus for `dataset_type=grain`: tokenized documents in ArrayRecord shards.

    python -m MaxText.data.prepare --input DIR_OR_GLOB --out DIR
        [--tokenizer_path M | --vocab_size V] [--shard_size N] [--eval_fraction F]
        [--add_bos true|false] [--add_eos true|false]
    python -m MaxText.data.prepare --format chat|preference ...   (chat_prepare.py)

`--tokenizer_path` names a sentencepiece `.model`, a Hugging Face `tokenizer.json`, a folder
holding one, or a checkpoint whose config names one (`tokenizer.tokenizer_file`); the file is
copied into `--out` under its own name and the manifest records its type.

Reads `.txt`, `.md` (markdown stripped as for dataset_type=text) and `.jsonl` (one document per
line, field `text`) files: every such file under a folder (recursively), or the files a glob
matches, in sorted order. Documents are streamed: one file (one `.jsonl` line) at a time is in
memory, never the corpus. Two passes: the first trains a sentencepiece tokenizer (the same
byte-fallback BPE options as dataset_type=text, on at most `MAX_TRAINING_CHARS` of training
text) unless `--tokenizer_path` names one; the second tokenizes and writes.

`--out` receives
  train-00000.array_record ...   one record per document: its token ids with BOS/EOS (unless
                                 --add_bos/--add_eos false: MaxText's keys, recorded in the
                                 manifest; a training config must agree), as
                                 little-endian `dtype` (uint16 when the vocabulary fits, else int32)
  eval-00000.array_record ...    with --eval_fraction > 0: the documents whose name hashes below
                                 the fraction (stable under reordering or adding files)
  tokenizer.model                the tokenizer used (trained or copied)
  manifest.json                  documents, tokens, shards, tokenizer, vocabulary, dtype

A shard holds at most `--shard_size` documents. Files are written under temporary names and
renamed when complete; manifest.json is written last, so a folder with a manifest is complete.
A progress bar (bytes of input read) is drawn on stderr unless --quiet.

Errors are one line and exit code 2 (`MaxText/exit_codes.py`): `--out` that cannot be written
(a file, a read-only folder; checked before any input is read) is a `path error:`; an input that
is not UTF-8 text (a binary, another encoding) or a jsonl line without a string `text` field is a
`data error:` naming the file (and line).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from MaxText import exit_codes
from MaxText.cluster.output_paths import writable_dir
from MaxText.data import text as text_lib
from MaxText.data.errors import DataError
from MaxText.data.shards import (  # noqa: F401  (MANIFEST, FORMAT: names other modules read here)
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SUFFIXES,
    Shards,
    input_files,
    is_eval,
    progress_bar,
    utf8_text,
)
from MaxText.data.text import Document
from MaxText.data.tokenizer import (
    SentencePieceTokenizer,
    load_tokenizer,
    tokenizer_file,
    tokenizer_type_of,
    train_sentencepiece,
)

TOKENIZER_FILE = "tokenizer.model"
_ENCODE_BATCH = 256


def iter_documents(files: Sequence[pathlib.Path], progress=None) -> Iterator[Document]:
    """The documents of `files`, one file (one jsonl line) in memory at a time. DataError for a
    file (or jsonl line) that is not UTF-8 text."""
    for path in files:
        if path.suffix == ".jsonl":
            with path.open("rb") as f:
                for lineno, line in enumerate(f, 1):
                    if progress is not None:
                        progress.update(len(line))
                    if not line.strip():
                        continue
                    decoded = utf8_text(line, f"{path}:{lineno}")
                    try:
                        text = json.loads(decoded)["text"]
                    except (ValueError, KeyError, TypeError):
                        raise DataError(
                            f"{path}:{lineno} is not a JSON object with a string field 'text'"
                        ) from None
                    if isinstance(text, str) and text:
                        yield Document(name=f"{path}:{lineno}", text=text)
            continue
        raw = path.read_bytes()
        if progress is not None:
            progress.update(len(raw))
        text = utf8_text(raw, str(path)).replace("\r\n", "\n")
        if path.suffix == ".md":
            text = text_lib.strip_markdown(text)
        if text.strip():
            yield Document(name=str(path), text=text)


def prepare(
    input_spec: str,
    out_dir: str,
    *,
    tokenizer_path: str = "",
    vocab_size: int = 1024,
    shard_size: int = 65536,
    eval_fraction: float = 0.0,
    quiet: bool = False,
    add_bos: bool = True,
    add_eos: bool = True,
) -> dict:
    """Writes the shards, tokenizer and manifest into `out_dir`; returns the manifest.
    `add_bos`/`add_eos`: whether each document starts with BOS / ends with EOS (MaxText's keys;
    the trainer refuses shards whose choice differs from its config's)."""
    if shard_size < 1:
        raise DataError(f"--shard_size={shard_size}: must be >= 1")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"--eval_fraction={eval_fraction}: must be in [0, 1)")
    out = writable_dir(out_dir, "--out")  # before reading any input
    files = input_files(input_spec)
    if (out / MANIFEST).exists():
        raise DataError(f"--out {out_dir!r} already holds a prepared dataset; use a new folder")

    tokenizer_name, tokenizer_type = TOKENIZER_FILE, "sentencepiece"
    if tokenizer_path:  # a .model, a Hugging Face tokenizer.json, a folder or a checkpoint
        source = tokenizer_file(tokenizer_path)
        tokenizer_type = tokenizer_type_of(source)
        tokenizer = load_tokenizer(str(source), tokenizer_type)
        proto = source.read_bytes()
        origin = f"file {source}"
        if tokenizer_type == "huggingface":
            tokenizer_name = source.name
    else:
        bar = progress_bar(files, "training tokenizer", quiet)
        failed: list[DataError] = []  # sentencepiece reads the documents in C++ and wraps errors

        def train_docs() -> Iterator[Document]:
            try:
                yield from (d for d in iter_documents(files, bar) if not is_eval(d, eval_fraction))
            except DataError as e:
                failed.append(e)
                raise

        try:
            proto = train_sentencepiece(train_docs(), vocab_size)
        except ValueError:
            if failed:
                raise failed[0] from None
            raise
        if bar is not None:
            bar.close()
        tokenizer = SentencePieceTokenizer(proto)
        origin = f"trained, vocab_size={vocab_size}"
    (out / tokenizer_name).write_bytes(proto)

    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32)
    writers = {s: Shards(out, s, shard_size, dtype) for s in ("train", "eval")}
    bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id >= 0 else []
    eos = [tokenizer.eos_id] if add_eos and tokenizer.eos_id >= 0 else []
    bar = progress_bar(files, "tokenizing", quiet)
    pending: list[Document] = []

    def flush() -> None:
        for doc, ids in zip(pending, tokenizer.encode_many([d.text for d in pending]), strict=True):
            split = "eval" if is_eval(doc, eval_fraction) else "train"
            writers[split].add(np.asarray(bos + ids + eos, np.int64))
        pending.clear()

    for doc in iter_documents(files, bar):
        pending.append(doc)
        if len(pending) == _ENCODE_BATCH:
            flush()
    flush()
    if bar is not None:
        bar.close()
    for w in writers.values():
        w.close()
    if not writers["train"].shards:
        raise DataError(f"--input {input_spec!r} gave no training document")

    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dtype": dtype.name,
        "kind": "text",
        "tokenizer": tokenizer_name,
        "tokenizer_type": tokenizer_type,
        "tokenizer_sha256": hashlib.sha256(proto).hexdigest(),
        "tokenizer_origin": origin,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "add_bos": bool(add_bos),
        "add_eos": bool(add_eos),
        "input": input_spec,
        "input_files": len(files),
        "eval_fraction": eval_fraction,
        "splits": {s: w.summary() for s, w in writers.items() if w.shards},
    }
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m MaxText.data.prepare",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--format",
        choices=("text", "chat", "preference"),
        default="text",
        help="text documents, chat conversations (loss mask) or preference pairs",
    )
    parser.add_argument("--input", required=True, help="folder or glob of .txt/.md/.jsonl files")
    parser.add_argument("--out", required=True, help="new folder for shards and manifest.json")
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--tokenizer_path",
        default="",
        help="a tokenizer file (sentencepiece .model, tokenizer.json), a folder or a checkpoint",
    )
    group.add_argument(
        "--vocab_size", type=int, default=1024, help="pieces of a trained tokenizer (1024)"
    )
    parser.add_argument("--shard_size", type=int, default=65536, help="documents per shard (65536)")
    parser.add_argument("--eval_fraction", type=float, default=0.0, help="documents held out (0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--chat_template",
        default="",
        help="chat/preference: the template if the tokenizer has none (chatml, llama3, mistral, "
        "gemma or a .jinja file)",
    )
    parser.add_argument(
        "--chat_date", default="", help="chat/preference: strftime_now's date (default today)"
    )
    for key in ("add_bos", "add_eos"):
        parser.add_argument(
            f"--{key}",
            type=_flag,
            default=True,
            metavar="true|false",
            help=f"{key.split('_')[1].upper()} around each document (MaxText's key; default true)",
        )
    from MaxText.config import tool_help

    if (words := tool_help.requested(argv)) is not None:  # --help [WORD]: options, then the keys
        return tool_help.show("MaxText.data.prepare", words, parser.format_help())
    args = parser.parse_args(argv)
    return exit_codes.run(lambda: _run(args))


def _run(args) -> int:
    try:
        m = _prepare(args)
    except ValueError as e:  # the tokenizer's errors (vocab_size too small, ...) are data errors
        if exit_codes.exit_code_of(e) is not None:
            raise
        raise DataError(str(e)) from None
    unit = {"text": "documents", "chat": "examples", "preference": "pairs"}[args.format]
    for split, s in m["splits"].items():
        print(
            f"{split}: {s['documents']:,} {unit}, {s['tokens']:,} tokens in "
            f"{len(s['shards'])} shards -> {args.out}/{split}-*.array_record"
        )
    if args.format != "text":
        print(
            f"{m['trained_tokens']:,} trained tokens; template {m['chat_template_origin']} "
            f"(sha256 {m['chat_template_sha256'][:12]}), date {m['chat_date']}"
            + (f"; {m['identical_pairs_skipped']} identical pairs skipped"
               if args.format == "preference" else "")
        )  # fmt: skip
    print(f"tokenizer: {m['vocab_size']} pieces ({m['tokenizer_origin']}); {args.out}/{MANIFEST}")
    return exit_codes.OK


def _prepare(args) -> dict:
    if args.format != "text":
        from MaxText.data.chat_prepare import prepare_chat

        return prepare_chat(
            args.input,
            args.out,
            kind=args.format,
            tokenizer_path=args.tokenizer_path,
            chat_template=args.chat_template,
            chat_date=args.chat_date,
            shard_size=args.shard_size,
            eval_fraction=args.eval_fraction,
            quiet=args.quiet,
        )
    return prepare(
        args.input,
        args.out,
        tokenizer_path=args.tokenizer_path,
        vocab_size=args.vocab_size,
        shard_size=args.shard_size,
        eval_fraction=args.eval_fraction,
        quiet=args.quiet,
        add_bos=args.add_bos,
        add_eos=args.add_eos,
    )


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r}: give true or false")
    return value == "true"


if __name__ == "__main__":
    sys.exit(main())
