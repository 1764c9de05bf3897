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
  time, so memory holds one tensor (plus orbax's per-file buffers) instead of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from MaxText.checkpoint.layout import restore_args
from MaxText.errors import CheckpointError, ConfigError

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
def _quiet_orbax():
    """orbax warns, through absl, about an item without its own _CHECKPOINT_METADATA and a
    registry without jax.Array (both expected here)."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_logger.setLevel(level)


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


def write(root: str | os.PathLike, step: int, params: Any, config: dict[str, Any]) -> Path:
    """Writes `{"params": params}` (a tree of `LazyLeaf`s) and `config` as `<root>/<step>`.

    The step folder appears only when complete (orbax writes a temporary folder and renames
    it). Refuses to overwrite an existing step. Returns the `items` folder."""
    root = Path(root).absolute()
    if (root / str(step)).exists():
        raise ConfigError(
            f"{root / str(step)} already exists; choose another base_output_directory or remove it"
        )
    with _quiet_orbax():
        _save(root, step, params, config)
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
