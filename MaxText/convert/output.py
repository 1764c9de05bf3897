"""Where `to_huggingface` writes: never over a model it was not asked to replace, never half a
folder.

`check_hf_output(out, overwrite=..., sources=...)` runs before anything is read or written and
refuses, in one `path error:` line (exit 2), without creating anything:
- a folder the checkpoint being exported was converted from (`sources`, `recorded_sources`: the
  checkpoint's `converted_from`, and for a run that of the checkpoint it started from), always,
  even with `hf_overwrite=true`: exporting into it would replace the weights the checkpoint came
  from;
- a folder that already holds a model (`config.json`, `*.safetensors`,
  `model.safetensors.index.json`, `pytorch_model*.bin`) or a file the export writes
  (`generation_config.json`, `tokenizer.json`, `tokenizer.model`), unless `hf_overwrite=true`;
- a file where the folder should be, a folder that cannot be made or written, and the staging
  folder of an export that was stopped (or is running).

`staged_folder(out, replace=...)` is where the export writes: `<out>/.exporting/`, moved into
`out` file by file only once everything is written. With `replace` (hf_overwrite=true) the
folder's old model files that the new export does not rewrite (old shards, an index, a
`pytorch_model*.bin`) are removed after the new ones are in place; other files stay. When the
export fails, the staging folder (and `out`, with the parents this export made) is removed and
the old model is untouched; a storage failure (disk full, permission, I/O) becomes one
`StorageError` line naming the path and the errno (exit 1).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from MaxText.checkpoint.integrity import classify, describe_failure
from MaxText.cluster.output_paths import creatable_dir, make_dirs, remove_made
from MaxText.config.checkpoint_keys import saved_config
from MaxText.errors import PathError, StorageError, UserError

MODEL_FILES = (
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
)
WRITTEN_FILES = ("generation_config.json", "tokenizer.json", "tokenizer.model")
STAGING = ".exporting"


def held_files(folder: Path) -> list[str]:
    """The names in `folder` that are a model's files or files an export writes."""
    if not folder.is_dir():
        return []
    patterns = (*MODEL_FILES, *WRITTEN_FILES)
    return sorted(
        p.name for p in folder.iterdir() if any(fnmatch.fnmatch(p.name, x) for x in patterns)
    )


def recorded_sources(path: str) -> list[Path]:
    """The Hugging Face folders the checkpoint at `path` comes from: the one it was converted
    from (`converted_from`), and, for a run, those of the checkpoint it started from
    (`load_parameters_path`), and so on."""
    found: list[Path] = []
    seen: set[str] = set()
    while path and path not in seen:
        seen.add(path)
        saved = saved_config(path) or {}
        if saved.get("converted_from"):
            found.append(Path(saved["converted_from"]))
        path = str(saved.get("load_parameters_path") or "")
    return found


def _same(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_hf_output(out: Path, *, overwrite: bool, sources: Sequence[Path]) -> Path:
    """`out` (absolute) once every refusal of the module docstring is ruled out."""
    out = Path(out).expanduser().absolute()
    for source in sources:
        if _same(out, Path(source)):
            raise PathError(
                f"hf_output_path={out} is the folder the checkpoint was converted from; export "
                f"into another folder (hf_overwrite=true never replaces a checkpoint's source)"
            )
    creatable_dir(out, "hf_output_path")
    if (out / STAGING).exists():
        raise PathError(
            f"hf_output_path={out} holds {out / STAGING}, left by an export that was stopped "
            f"(or is running); remove it and export again"
        )
    held = held_files(out)
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise PathError(
            f"hf_output_path={out} already holds a model ({shown}); export into a new or empty "
            f"folder, or set hf_overwrite=true to replace it"
        )
    return out


def _replace(out: Path, staging: Path) -> None:
    """Moves the staged files into `out` (an existing file of the same name is replaced
    atomically), then removes the old model files the new export did not rewrite."""
    old = set(held_files(out))
    new = sorted(p.name for p in staging.iterdir())
    for name in new:
        os.replace(staging / name, out / name)
    for name in sorted(old - set(new)):
        (out / name).unlink()
    staging.rmdir()


@contextlib.contextmanager
def staged_folder(out: Path, *, replace: bool) -> Iterator[Path]:
    """The folder to write the export into (see the module docstring)."""
    staging = out / STAGING
    made: list[Path] = []
    mine = False  # whether `staging` is this export's (a concurrent one's is never removed)
    try:
        made = make_dirs(out)
        staging.mkdir()
        mine = True
        yield staging
        if not replace and held_files(out):  # written by someone else meanwhile: kept
            raise PathError(
                f"hf_output_path={out} gained {', '.join(held_files(out))} during the export; "
                f"nothing was replaced"
            )
        _replace(out, staging)
    except BaseException as e:
        if mine:
            shutil.rmtree(staging, ignore_errors=True)
        remove_made(made)
        if isinstance(e, FileExistsError) and not mine:
            raise PathError(
                f"hf_output_path={out}: {staging} appeared while starting the export (another "
                f"export into this folder is running); nothing was written"
            ) from None
        if isinstance(e, Exception) and not isinstance(e, UserError) and classify(e) is not None:
            kept = "" if made else "; the folder's earlier files are unchanged"
            raise StorageError(
                f"writing {out} failed: {describe_failure(e, staging)}; the partial output was "
                f"removed{kept}; free space (or fix the permissions) and export again"
            ) from None
        raise
