"""Tokenizers: a sentencepiece BPE model trained on the training split and cached, or loaded.

`load_or_train_sentencepiece` owns the policy: with `tokenizer_path` set it loads that model
file and never trains; otherwise it trains a byte-fallback BPE model of `vocab_size` pieces on
the *training* documents only (so held-out text never shapes the vocabulary) and caches it at
`{cache}/tokenizers/spm_bpe_v{vocab_size}_{key}.model`, where `key` hashes the corpus and the
trainer options. Training is deterministic, so processes that train concurrently produce the
same model; the first one to finish publishes it and all of them load the published file.

Our trained models reserve ids pad=0, unk=1, bos=2, eos=3, keep text exactly (identity
normalization, no whitespace folding) and encode a newline as its own piece, so
`decode(encode(s)) == s` for any string (unseen characters fall back to UTF-8 bytes).

`IdTokenizer` is the stand-in for synthetic data, whose "text" is space-separated token ids.
`HuggingFaceTokenizer` reads a Hugging Face `tokenizer.json` (Llama 3's byte-level BPE) with the
`tokenizers` library (`tokenizer_type=huggingface`); `load_tokenizer` picks by tokenizer_type.
Every tokenizer carries `add_bos`/`add_eos` (MaxText's keys, default true): whether documents
(and, for BOS, generation prompts) are wrapped in those ids.
"""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import sentencepiece as spm

from MaxText.data import cache as cache_lib
from MaxText.data.errors import DataNotFoundError
from MaxText.data.text import Document

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# Everything that shapes a trained model, hashed into its cache key. Changing any value here
# (or the corpus) trains a new model instead of reusing a cached one.
_TRAINER_OPTIONS = {
    "model_type": "bpe",
    "character_coverage": 1.0,
    "byte_fallback": True,
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "split_digits": True,
    "user_defined_symbols": ["\n"],
    "pad_id": PAD_ID,
    "unk_id": UNK_ID,
    "bos_id": BOS_ID,
    "eos_id": EOS_ID,
    "max_sentence_length": 1 << 16,
    "hard_vocab_limit": False,  # a corpus too small for vocab_size yields a smaller vocab
    "input_sentence_size": 0,  # use every sentence we feed (we cap the text ourselves)
    "num_threads": 4,  # fixed so the serialized model does not depend on the host
}
# Text fed to the trainer is capped (in corpus order) so huge tfds corpora train in bounded time.
MAX_TRAINING_CHARS = 200_000_000


class Tokenizer(Protocol):
    """What the trainer and `generate` rely on."""

    vocab_size: int
    bos_id: int  # -1 when the model has none
    eos_id: int  # -1 when the model has none
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class SentencePieceTokenizer:
    """A sentencepiece model; `origin` is where it came from: 'trained', 'cache' or 'file'."""

    add_bos = True  # set per run from the config (`with_special_tokens`)
    add_eos = True

    def __init__(
        self, model_proto: bytes, *, path: pathlib.Path | None = None, origin: str = "file"
    ):
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.path = path
        self.origin = origin
        self.model_hash = hashlib.sha256(model_proto).hexdigest()
        self.vocab_size = int(self._sp.get_piece_size())
        self.bos_id = int(self._sp.bos_id())
        self.eos_id = int(self._sp.eos_id())
        pad = int(self._sp.pad_id())
        # Padding is always masked out, so any in-range id works for models without a pad piece.
        self.pad_id = pad if pad >= 0 else 0

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        return self._sp.encode(text)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several texts (batched through sentencepiece's threads)."""
        return self._sp.encode(texts, num_threads=2)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each token's [start, end) character span in `text`."""
        proto = self._sp.encode(text, out_type="immutable_proto")
        char_of_byte = _char_of_byte(text)
        ids = [int(p.id) for p in proto.pieces]
        spans = [(char_of_byte[p.begin], char_of_byte[p.end]) for p in proto.pieces]
        return ids, spans

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; control ids (pad/bos/eos) vanish, out-of-vocab ids (a model vocab
        padded beyond the tokenizer's) decode as the unknown piece."""
        unk = max(int(self._sp.unk_id()), 0)
        return self._sp.decode([int(i) if 0 <= int(i) < self.vocab_size else unk for i in ids])

    def __repr__(self) -> str:
        return (
            f"SentencePieceTokenizer(vocab_size={self.vocab_size}, origin={self.origin!r}, "
            f"path={str(self.path)!r})"
        )


class HuggingFaceTokenizer:
    """A Hugging Face `tokenizer.json` read with the `tokenizers` library. BOS/EOS/pad are the
    `bos_token`/`eos_token`/`pad_token` of a `tokenizer_config.json` beside it, else the
    usual Llama names (`<|begin_of_text|>`/`<s>`, `<|end_of_text|>`/`</s>`); -1 when absent."""

    origin = "file"
    add_bos = True
    add_eos = True
    _BOS = ("<|begin_of_text|>", "<s>")
    _EOS = ("<|end_of_text|>", "</s>")
    _PAD = ("<pad>", "<|finetune_right_pad_id|>")

    def __init__(self, path: pathlib.Path):
        from tokenizers import Tokenizer as _Tokenizer

        raw = path.read_bytes()
        self._tok = _Tokenizer.from_str(raw.decode("utf-8"))
        self.path = path
        self.model_hash = hashlib.sha256(raw).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        named = self._special_names(path.parent / "tokenizer_config.json")
        self.bos_id = self._id_of(named.get("bos_token"), self._BOS)
        self.eos_id = self._id_of(named.get("eos_token"), self._EOS)
        pad = self._id_of(named.get("pad_token"), self._PAD)
        self.pad_id = pad if pad >= 0 else 0  # padding is masked out: any in-range id works

    @staticmethod
    def _special_names(config_path: pathlib.Path) -> dict[str, str]:
        if not config_path.is_file():
            return {}
        try:
            raw = json.loads(config_path.read_text())
        except (ValueError, UnicodeDecodeError):
            return {}
        out = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            value = raw.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
        return out

    def _id_of(self, name: str | None, fallbacks: Sequence[str]) -> int:
        for candidate in ((name,) if name else ()) + tuple(fallbacks):
            token_id = self._tok.token_to_id(candidate)
            if token_id is not None:
                return int(token_id)
        return -1

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (special tokens written in it are theirs, as transformers'
        apply_chat_template tokenizes) and each token's [start, end) character span."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def id_to_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id)) or ""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; special tokens vanish, ids beyond the vocabulary are dropped."""
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer(vocab_size={self.vocab_size}, path={str(self.path)!r})"


def load_huggingface(tokenizer_path: str) -> HuggingFaceTokenizer:
    """A Hugging Face tokenizer.json (or the folder holding one)."""
    path = pathlib.Path(tokenizer_path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataNotFoundError(
            f"tokenizer_path={tokenizer_path!r}: no tokenizer.json there; tokenizer_type="
            "huggingface reads a Hugging Face tokenizer.json file"
        )
    try:
        return HuggingFaceTokenizer(path)
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises bare Exceptions)
        raise ValueError(
            f"tokenizer_path={tokenizer_path!r} is not a Hugging Face tokenizer.json: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None


def load_tokenizer(tokenizer_path: str, tokenizer_type: str):
    """The tokenizer file at `tokenizer_path`, read as `tokenizer_type` (sentencepiece or
    huggingface)."""
    if tokenizer_type == "huggingface":
        return load_huggingface(tokenizer_path)
    return load_sentencepiece(tokenizer_path)


def with_special_tokens(tokenizer, add_bos: bool, add_eos: bool):
    """`tokenizer` with the run's add_bos/add_eos (what documents and prompts are wrapped in)."""
    tokenizer.add_bos, tokenizer.add_eos = bool(add_bos), bool(add_eos)
    return tokenizer


class IdTokenizer:
    """Tokenizer of synthetic data: text is whitespace-separated decimal ids (e.g. "5 17 3")."""

    origin = "synthetic"
    add_bos = True
    add_eos = True

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.pad_id, self.bos_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            raise ValueError(
                f"dataset_type=synthetic has no real tokenizer: text must be space-separated token "
                f"ids below {self.vocab_size}, got {text[:40]!r}"
            ) from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside [0, vocab_size={self.vocab_size})")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def load_sentencepiece(tokenizer_path: str) -> SentencePieceTokenizer:
    """Loads an existing sentencepiece model file; nothing is trained or cached."""
    path = pathlib.Path(tokenizer_path).expanduser()
    if not path.is_file():
        raise DataNotFoundError(
            f"tokenizer_path={tokenizer_path!r} is not a file; give a sentencepiece .model file, "
            "or leave tokenizer_path empty to train one on the training split"
        )
    try:
        return SentencePieceTokenizer(path.read_bytes(), path=path, origin="file")
    except RuntimeError as e:
        raise ValueError(
            f"tokenizer_path={tokenizer_path!r} is not a sentencepiece model: {e}"
        ) from None


def trained_model_path(cache_root: pathlib.Path, corpus_key: str, vocab_size: int) -> pathlib.Path:
    """Where the model trained on a corpus (identified by `corpus_key`) is cached."""
    options = json.dumps(_TRAINER_OPTIONS, sort_keys=True) + f"|chars<={MAX_TRAINING_CHARS}"
    key = hashlib.sha256(f"{corpus_key}|{vocab_size}|{options}".encode()).hexdigest()[:16]
    return cache_root / "tokenizers" / f"spm_bpe_v{vocab_size}_{key}.model"


def load_or_train_sentencepiece(
    train_docs: list[Document], *, vocab_size: int, corpus_key: str, cache_root: pathlib.Path
) -> SentencePieceTokenizer:
    """The cached model for (`corpus_key`, `vocab_size`), training and publishing it if absent."""
    path = trained_model_path(cache_root, corpus_key, vocab_size)
    if path.is_file():
        return SentencePieceTokenizer(path.read_bytes(), path=path, origin="cache")
    proto = train_sentencepiece(train_docs, vocab_size)
    cache_lib.publish_bytes(path, proto)
    # Load what was published: if another process won the race, use its (identical) model.
    return SentencePieceTokenizer(path.read_bytes(), path=path, origin="trained")


def train_sentencepiece(docs: list[Document], vocab_size: int) -> bytes:
    """Trains a byte-fallback BPE model on `docs` and returns the serialized model."""
    out = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_sentences(docs),
            model_writer=out,
            vocab_size=vocab_size,
            minloglevel=2,
            **_TRAINER_OPTIONS,
        )
    except RuntimeError as e:
        raise ValueError(
            f"training a sentencepiece tokenizer with vocab_size={vocab_size} failed: {e}; a "
            "byte-fallback model needs vocab_size of at least ~300 plus the corpus' distinct "
            "characters"
        ) from None
    return out.getvalue()


def _training_sentences(docs: list[Document]) -> Iterator[str]:
    """Paragraphs of the documents (newlines inside kept), long ones cut at line breaks."""
    budget = MAX_TRAINING_CHARS
    limit = _TRAINER_OPTIONS["max_sentence_length"] // 4  # bytes per char <= 4 in UTF-8
    for doc in docs:
        for para in doc.text.split("\n\n"):
            for piece in _chunks(para, limit):
                if budget <= 0:
                    return
                budget -= len(piece)
                yield piece


def _chunks(text: str, limit: int) -> Iterator[str]:
    if len(text) <= limit:
        if text.strip():
            yield text
        return
    start = 0
    while start < len(text):
        end = min(start + limit, len(text))
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        if text[start:end].strip():
            yield text[start:end]
        start = end


def _char_of_byte(text: str) -> list[int]:
    """For each UTF-8 byte offset of `text` (and its end), the character offset holding it."""
    out: list[int] = []
    for i, ch in enumerate(text):
        out.extend([i] * len(ch.encode("utf-8")))
    out.append(len(text))
    return out


def tokenizer_file(tokenizer_path: str) -> pathlib.Path:
    """The tokenizer file `tokenizer_path` names: the file itself (`tokenizer.json` or a
    sentencepiece `.model`), a folder holding one (a Hugging Face model, a converted checkpoint's
    tokenizer folder), or a checkpoint whose saved config names one (`tokenizer_path`)."""
    from MaxText.config.checkpoint_keys import saved_config

    path = pathlib.Path(tokenizer_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return path / name
        saved = saved_config(str(path)) or {}
        if saved.get("tokenizer_path"):
            return tokenizer_file(str(saved["tokenizer_path"]))
    raise DataNotFoundError(
        f"--tokenizer_path {tokenizer_path!r}: no tokenizer there; give a tokenizer.json, a "
        "sentencepiece .model, a folder holding one, or a checkpoint whose config names one"
    )


def tokenizer_type_of(path: pathlib.Path) -> str:
    return "huggingface" if path.suffix == ".json" else "sentencepiece"
