"""Parameters-only checkpoints at MaxText's path: `<root>/<step>/items` (+ `<root>/<step>/config`).

This is what `python -m MaxText.to_maxtext` writes (step 0) and what MaxText's own converters
write: an orbax step folder whose `items` item is the PyTree `{"params": <canonical params>}`
(every decoder layer its own `layers_<i>`, as in every checkpoint here, see `layout.py`) and whose
`config` item is the JSON of the config that describes the model (the same dict a training
checkpoint stores, so its model keys can be read back: `MaxText/config/checkpoint_keys.py`).

- `locate(path)`: `load_parameters_path` names such a checkpoint as `<root>/<step>/items`,
  `<root>/<step>` or `<root>` (its newest step); None when `path` is not one (a training run's
  folders are handled by `manager.py`).
- `read_params(location, abstract, shardings)`: the canonical params, placed as global arrays
  with `shardings` (one per leaf; None = not read by this process) or as numpy arrays.
- `stored_params(item_dir)`: names, shapes and dtypes on disk.
- `read_subtree(item_dir, subtree)`: any sub-tree of an item (`items` or a training run's
  `state`) as numpy arrays; exports read one layer at a time with it.
- `write(root, step, leaves, config)`: writes the checkpoint **streaming**: each leaf is a
  `LazyLeaf` whose array is produced only when orbax writes it and dropped right after, one at a
  time, so memory holds one tensor (plus orbax's per-file buffers) instead of the model. Like a
  training save it records `checksums.json` (`integrity.py`) before the step appears under its
  number; a failed write leaves nothing behind (one `I/O error:` line for a storage failure).
- `verify(location)`: the files checked against those checksums before they are read; a damaged
  checkpoint is one `checkpoint error:` line naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from MaxText.checkpoint.integrity import (
    check_before_reading,
    classify,
    describe_failure,
    record_checksums,
)
from MaxText.checkpoint.layout import restore_args
from MaxText.checkpoint.pending_save import quiet_abandoned_writes
from MaxText.cluster.output_paths import make_dirs, remove_made
from MaxText.errors import CheckpointError, ConfigError, PathError, StorageError, UserError

ITEM = "items"
CONFIG_ITEM = "config"


@dataclasses.dataclass(frozen=True)
class Location:
    root: Path
    step: int

    @property
    def item_dir(self) -> Path:
        return self.root / str(self.step) / ITEM

    @property
    def config_file(self) -> Path:
        return self.root / str(self.step) / CONFIG_ITEM / "metadata"


def _steps_with_items(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / ITEM).is_dir())


def locate(path: str | os.PathLike) -> Location | None:
    """The parameters-only checkpoint `path` names (see the module docstring), or None."""
    p = Path(path)
    if p.name == ITEM and p.parent.name.isdigit() and p.is_dir():
        return Location(p.parent.parent, int(p.parent.name))
    if p.name.isdigit() and (p / ITEM).is_dir():
        return Location(p.parent, int(p.name))
    steps = _steps_with_items(p)
    return Location(p, steps[-1]) if steps else None


def read_config(location: Location) -> dict[str, Any] | None:
    """The config dict saved with the checkpoint; None when it has none (e.g. written by
    MaxText itself: then the model keys must be given on the command line)."""
    if not location.config_file.is_file():
        return None
    try:
        return json.loads(location.config_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{location.config_file} is not valid JSON ({e})") from None


def verify(location: Location) -> None:
    """The checkpoint's files checked before anything reads them (`integrity.check_before_reading`:
    its checksums, or, written before they were recorded, every stored chunk); damage is one
    `CheckpointError` line naming the file and saying to convert again."""
    source = None
    with contextlib.suppress(CheckpointError, OSError):  # named by the check below
        source = (read_config(location) or {}).get("converted_from")
    again = "convert it again into a new folder"
    if source:
        again += f" (python -m MaxText.to_maxtext ... hf_model_path={source})"
    check_before_reading(location.root / str(location.step), ITEM, again)


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler())


def read_subtree(item_dir: Path, subtree: Any) -> Any:
    """The leaves of `subtree` (a tree of `jax.ShapeDtypeStruct`s, a sub-tree of the item) as
    numpy arrays in their stored dtype, read from the orbax PyTree at `item_dir`."""
    import orbax.checkpoint as ocp

    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), subtree)
    with _quiet_orbax():
        return _checkpointer().restore(
            item_dir,
            args=ocp.args.PyTreeRestore(item=subtree, restore_args=args, partial_restore=True),
        )


def stored_params(item_dir: Path) -> Any:
    """The item's `params` tree as stored: `jax.ShapeDtypeStruct` leaves (shape and dtype on
    disk)."""
    with _quiet_orbax():
        tree = _checkpointer().metadata(item_dir).item_metadata.tree
    if "params" not in tree:
        raise CheckpointError(f"{item_dir} holds no params")
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree["params"])


@contextlib.contextmanager
def _quiet_orbax(writing: bool = False):
    """orbax warns, through absl, about an item without its own _CHECKPOINT_METADATA and a
    registry without jax.Array (both expected here). `writing`: a write that fails is reported
    by `write` in one line, so orbax's logged traceback of it, asyncio's reports of the writes it
    abandons and their "Event loop is closed" noise are dropped too."""
    loggers = [logging.getLogger("absl")] + ([logging.getLogger("asyncio")] if writing else [])
    levels = [x.level for x in loggers]
    for x in loggers:
        x.setLevel(logging.CRITICAL if writing else logging.ERROR)
    if writing:
        quiet_abandoned_writes()
    try:
        yield
    finally:
        for x, level in zip(loggers, levels, strict=True):
            x.setLevel(level)


def read_params(location: Location, abstract: Any, shardings: Sequence[Any] | None) -> Any:
    """The canonical params tree `abstract` from `location`: global arrays placed by
    `shardings` (one per leaf, in `abstract`'s leaf order; None = skipped by this process), or
    numpy arrays when `shardings` is None. A missing tensor or another shape is a ConfigError."""
    import orbax.checkpoint as ocp

    item_dir = location.item_dir
    _check_shapes(stored_params(item_dir), abstract, item_dir)
    if shardings is None:
        return read_subtree(item_dir, {"params": abstract})["params"]
    leaves, treedef = jax.tree.flatten(abstract)
    items, args = restore_args(leaves, list(shardings))
    with _quiet_orbax():
        got = _checkpointer().restore(
            item_dir,
            args=ocp.args.PyTreeRestore(
                item={"params": jax.tree.unflatten(treedef, items)},
                restore_args={"params": jax.tree.unflatten(treedef, args)},
                partial_restore=True,
            ),
        )["params"]
    return jax.tree.unflatten(treedef, jax.tree.leaves(got))


def _check_shapes(stored: Any, abstract: Any, item_dir: Path) -> None:
    have = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(stored)[0]}
    for path, want in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        name = jax.tree_util.keystr(path)
        if name not in have:
            raise ConfigError(
                f"{item_dir} has no parameter {name}; it holds another model (set the model keys "
                f"of the checkpoint, or leave them out to take them from it)"
            )
        if tuple(have[name].shape) != tuple(want.shape):
            raise ConfigError(
                f"{item_dir}: parameter {name} has shape {tuple(have[name].shape)}, the model "
                f"wants {tuple(want.shape)}; use the checkpoint's model keys"
            )


# -------------------------------------------------------------------------------- streaming write


class LazyLeaf:
    """A leaf whose array is made by `produce()` only when it is written (see `write`)."""

    def __init__(self, shape: Sequence[int], dtype: Any, produce: Callable[[], np.ndarray]):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self._produce = produce

    def materialize(self) -> np.ndarray:
        array = np.ascontiguousarray(self._produce(), dtype=self.dtype)
        if array.shape != self.shape:
            raise AssertionError(f"produced shape {array.shape}, declared {self.shape}")
        return array


def _streaming_registry():
    """An orbax type registry with one handler: numpy arrays written one leaf at a time."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint import future

    class StreamingNumpyHandler(ocp.type_handlers.NumpyHandler):
        """orbax's numpy handler (same files and metadata, read back as np.ndarray), except that
        leaves are `LazyLeaf`s made and written one after another: orbax's own handler copies
        every array up front and writes them all at once (twice the model in memory)."""

        async def serialize(self, values, infos, args=None):
            args = args or [ocp.type_handlers.SaveArgs()] * len(values)

            async def write_one_by_one():
                for value, info, arg in zip(values, infos, args, strict=True):
                    array = value.materialize()
                    await self._background_serialize([array], [info], [arg])
                    del array

            return [future.CommitFutureAwaitingContractedSignals(write_one_by_one())]

    return ocp.type_handlers.create_type_handler_registry((LazyLeaf, StreamingNumpyHandler()))


STAGING = ".converting"  # `<root>/<step>.converting/`: a step being written (never read)


def check_new_step(root: Path, step: int) -> None:
    """`write(root, step, ...)` may go ahead: neither the step nor a step being written (left by
    a conversion that was stopped) is in `root` (raises PathError)."""
    for name, why in (
        (str(step), "already exists; choose another base_output_directory or remove it"),
        (f"{step}{STAGING}", "is left from a conversion that was stopped (or is running); "
                             "remove it, or choose another base_output_directory"),
    ):  # fmt: skip
        if (root / name).exists():
            raise PathError(f"base_output_directory={root}: {root / name} {why}")


def write(root: str | os.PathLike, step: int, params: Any, config: dict[str, Any]) -> Path:
    """Writes `{"params": params}` (a tree of `LazyLeaf`s) and `config` as `<root>/<step>` with
    its `checksums.json`; returns the `items` folder.

    orbax writes the step into `<root>/<step>.converting/`; its checksums are recorded there and
    it is renamed into place, so `<root>/<step>` appears complete and checked, or not at all.
    Refuses an existing step (`check_new_step`). When anything fails, the partial output is
    removed (and `root` with the parents this call made); a storage failure (disk full,
    permission, I/O) becomes one `StorageError` line naming the path and the errno. A
    `UserError` raised by a leaf's producer (a tensor refused as it streams) propagates as it is.
    """
    root = Path(root).absolute()
    check_new_step(root, step)
    staging = root / f"{step}{STAGING}"
    made: list[Path] = []
    mine = False  # whether `staging` is this call's (a concurrent writer's is never removed)
    try:
        made = make_dirs(root)
        staging.mkdir()
        mine = True
        with _quiet_orbax(writing=True):
            _save(staging, step, params, config)
        record_checksums(staging / str(step))
        os.rename(staging / str(step), root / str(step))
        staging.rmdir()
    except BaseException as e:
        if mine:
            shutil.rmtree(staging, ignore_errors=True)
        remove_made(made)
        if isinstance(e, FileExistsError) and not mine:
            check_new_step(root, step)  # another conversion started meanwhile: named
        if isinstance(e, Exception) and not isinstance(e, UserError) and classify(e) is not None:
            raise StorageError(
                f"writing {root / str(step)} failed: {describe_failure(e, staging)}; the partial "
                f"output was removed; free space (or fix the permissions) and convert again"
            ) from None
        raise
    return root / str(step) / ITEM


def _save(root: Path, step: int, params: Any, config: dict[str, Any]) -> None:
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(
        root,
        item_names=(ITEM, CONFIG_ITEM),
        item_handlers={
            ITEM: ocp.PyTreeCheckpointHandler(type_handler_registry=_streaming_registry()),
            CONFIG_ITEM: ocp.JsonCheckpointHandler(),
        },
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True),
    )
    try:
        manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    ITEM: ocp.args.PyTreeSave({"params": params}),
                    CONFIG_ITEM: ocp.args.JsonSave(config),
                }
            ),
            force=True,
        )
        manager.wait_until_finished()
    finally:
        manager.close()
