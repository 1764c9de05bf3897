"""Checkpoints: save during training, resume by `run_name`, start from another run's parameters.

One orbax `CheckpointManager` per run, under `{base_output_directory}/{run_name}/checkpoints/`:

    checkpoints/<step>/state/      {"step", "params", "opt_state"}: orbax PyTree (OCDBT + zarr)
                      /data_iter/  the training iterator's position (JSON, `data.train.get_state()`)
                      /rng/        the seed and PRNG key the run derives its randomness from (JSON)
                      /config/     every key and derived value of the config that wrote it (JSON)

The loop (`MaxText/train.py`) talks to one `Checkpoints` object:

- `restore_or_init(data)` -> the state to start from: the latest complete, readable checkpoint of
  this run (and the data iterator moved to its position), else the parameters of
  `load_parameters_path` in a fresh state, else a fresh state. Logs one line naming the step.
- `maybe_save(step, state, data, final)` saves every `checkpoint_period` steps and at the last step;
  with `async_checkpointing` the arrays are copied to host memory, then written by a background
  thread while training continues; the next save (and `close()`) waits for the previous one.
- `close()` waits for a pending save and releases the manager.

**Canonical layout.** The `state` item holds every array once, at its global shape, in one tree
for every layout (every decoder layer its own `layers_<i>`, scanned or not): nothing on disk depends
on `scan_layers`, `pipeline_parallelism`, the schedule, virtual stages or SPMD axes (stacked layers
are split per layer on save and stacked again on restore, `MaxText/checkpoint/layout.py`). A
pipelined state (`MpmdArray` leaves spread over groups) is saved leaf by leaf from the group that
holds it, without gathering anything onto one device; a value held by several groups (the step
counter) is written once. On restore every leaf is read straight onto the devices the target
layout wants it on: the SPMD step's shardings, or, pipelined, the groups whose compiled tasks
read it.

**Crash safety.** orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to `<step>`
only when every item is written, so a killed save never looks complete; leftover temporary
folders are removed when the next run opens the manager. Before a checkpoint is restored its
metadata files are parsed and every stored array chunk is read once (`integrity.py`); a
complete checkpoint that cannot be read (truncated or corrupt file) is skipped with a warning
naming it, moved to `{run}/checkpoints_corrupt/` (so the step can be written again), and the
previous one is used. Only storage and decoding errors count as "cannot be read"
(`is_storage_error`: a missing or unreadable file, invalid JSON, tensorstore's read/decode
statuses); any other exception is a bug, propagates with its traceback and moves nothing.

**Several processes** (`num_processes>1`): every process opens the same manager (a folder all of
them see) and saves collectively. orbax writes only arrays that span processes, so a pipelined
state is first spread over all groups (`jaxpp.mpmd_to_spmd_reshard`) and each process writes its
part; on restore a process reads only the leaves its groups hold (orbax's placeholder for the
rest). Whether a step is readable is agreed by all processes: it is used only if every process
read it, and moved aside only if none could.

Errors the user can fix raise one line: `ConfigError` when the checkpoint disagrees with the
config (a different model, seed or dataset), `CheckpointError` when there is no readable
checkpoint where one was asked for.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from MaxText.checkpoint import parameters
from MaxText.checkpoint.integrity import (
    UnreadableCheckpointError,  # noqa: F401 (part of this module's interface)
    check_files,
    first_cause_line,
    is_storage_error,
    verify_arrays,
)
from MaxText.checkpoint.layout import CanonicalLayout, numpy_stack, placement_for, restore_args
from MaxText.config import Config, ConfigError
from MaxText.errors import CheckpointError, UserError

# orbax is imported where it is used: importing it logs through absl, which installs a root log
# handler when there is none yet and so would swallow the trainer's `logging.basicConfig`.

log = logging.getLogger(__name__)

# 2: scanned runs store every layer as `layers_<i>` (format 1 stored them stacked under `layers`).
FORMAT_VERSION = 2
ITEMS = ("state", "data_iter", "rng", "config")
CORRUPT_DIR = "checkpoints_corrupt"

# Keys that fix the shapes of the saved arrays: a checkpoint restores only into the same model.
MODEL_KEYS = (
    "decoder_block",
    "num_decoder_layers",
    "emb_dim",
    "num_query_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "vocab_size",
    "logits_via_embedding",
)
# Keys that describe how a run is laid out on devices; they may change between save and restore.
LAYOUT_KEYS = (
    "ici_data_parallelism",
    "ici_fsdp_parallelism",
    "ici_tensor_parallelism",
    "ici_pipeline_parallelism",
    "dcn_data_parallelism",
    "dcn_fsdp_parallelism",
    "dcn_tensor_parallelism",
    "dcn_pipeline_parallelism",
    "pipeline_schedule",
    "num_pipeline_repeats",
    "num_pipeline_microbatches",
    "num_processes",
)


# --------------------------------------------------------------------------- placement of leaves


def _open_manager(directory: str | os.PathLike, config: Config | None, read_only: bool):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else config.max_num_checkpoints_to_keep,
        save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=bool(config and config.async_checkpointing) and not read_only,
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
        # Do not read every step's metadata file when opening: a corrupt one is dealt with below.
        lightweight_initialize=True,
    )
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    if read_only:  # orbax warns that a read-only manager is read-only
        absl_logger.setLevel(logging.ERROR)
    try:
        return ocp.CheckpointManager(Path(directory).absolute(), item_names=ITEMS, options=options)
    finally:
        absl_logger.setLevel(level)


def find_step_dir(path: str | os.PathLike) -> tuple[Path, int | None]:
    """`path` is a checkpoints folder (-> its latest step) or one step's folder.

    Returns (checkpoints folder, step or None for "the latest readable").
    """
    p = Path(path)
    if (p / "state").is_dir() and p.name.isdigit():
        return p.parent, int(p.name)
    if (p / "checkpoints").is_dir():  # a run folder
        return p / "checkpoints", None
    return p, None


@dataclasses.dataclass
class Restored:
    step: int
    directory: Path
    state: Any  # the requested part of the state tree, placed
    items: dict[str, Any]  # the JSON items read ("config", "rng", "data_iter")


def restore_latest(
    manager: Any,
    directory: Path,
    abstract_tree: Any,
    shardings: Sequence[Any],
    *,
    config: Config | None,
    step: int | None = None,
    json_items: Sequence[str] = ("config", "rng", "data_iter"),
    partial: bool = False,
    restore_as_numpy: bool = False,
    quarantine: Path | None = None,
) -> Restored | None:
    """Reads the newest readable checkpoint of `manager` (or exactly `step`).

    `abstract_tree` gives the structure and shapes to read from the `state` item (all of it, or
    with `partial` a sub-tree such as `{"params": ...}`); `shardings` one sharding per leaf.
    Unreadable checkpoints are skipped with a warning (and moved to `quarantine` if given).
    Returns None when there is no checkpoint at all; raises CheckpointError when none is
    readable, ConfigError when the checkpoint holds a different model than `config`.
    """
    import orbax.checkpoint as ocp

    steps = sorted(manager.all_steps(), reverse=True)
    if step is not None:
        if step not in steps:
            raise CheckpointError(f"no complete checkpoint for step {step} in {directory}")
        steps = [step]
    if not steps:
        return None
    leaves, treedef = jax.tree.flatten(abstract_tree)
    if restore_as_numpy:
        items, args = leaves, [ocp.RestoreArgs(restore_type=np.ndarray) for _ in leaves]
    else:
        items, args = restore_args(leaves, shardings)
    skipped = []
    for s in steps:
        step_dir = directory / str(s)
        restored = error = None
        try:
            meta = _read_json(manager, s, step_dir, json_items)
            if config is not None and "config" in meta:
                _check_model(meta["config"], config, step_dir)
            state = _read_state(manager, s, step_dir, treedef, items, args, partial)
            restored = Restored(step=s, directory=step_dir, state=state, items=meta)
        except UserError:
            raise  # the same on every process: it holds another model
        except Exception as e:  # noqa: BLE001 (storage errors only, see is_storage_error)
            if not is_storage_error(e):
                raise  # a bug, not a damaged checkpoint: nothing is skipped or moved
            error = e
        readable = _count_everywhere(restored is not None)
        if readable == jax.process_count():
            if skipped:
                manager.reload()
            return restored
        if error is None:
            error = RuntimeError("another process could not read it")
        # Moved aside only when no process could read it (a checkpoint one process reads is not
        # corrupt: the others see another filesystem or failed for another reason).
        _skip(step_dir, error, quarantine if readable == 0 else None, skipped)
    raise CheckpointError(
        f"no readable checkpoint in {directory} (skipped {', '.join(skipped)}); move the folder "
        f"away to start the run from scratch"
    )


def _read_json(manager, step: int, step_dir: Path, names: Sequence[str]) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    check_files(step_dir, names, state=False)
    got = manager.restore(
        step, args=ocp.args.Composite(**{k: ocp.args.JsonRestore() for k in names})
    )
    return {k: got[k] for k in names}


def _check_model(saved: dict, config: Config, step_dir: Path) -> None:
    if saved.get("format", 1) < 2 and saved.get("scan_layers"):
        raise CheckpointError(
            f"checkpoint {step_dir} was written with scan_layers=true in checkpoint format 1 "
            f"(layers stacked on disk), which this version no longer reads; re-save it with the "
            f"version that wrote it, or start a new run_name"
        )
    wrong = [
        f"{k}={saved.get(k)!r} in the checkpoint vs {getattr(config, k)!r} now"
        for k in MODEL_KEYS
        if saved.get(k) != getattr(config, k)
    ]
    if wrong:
        raise ConfigError(
            f"checkpoint {step_dir} holds a different model: {'; '.join(wrong)}; "
            f"use the same model keys or another run_name"
        )


def _read_state(manager, step, step_dir, treedef, items, args, partial: bool) -> Any:
    """The `state` item's arrays (after reading every stored chunk once, see `verify_arrays`)."""
    import orbax.checkpoint as ocp

    check_files(step_dir, (), state=True)
    verify_arrays(step_dir / "state", "params." if partial else "")
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=jax.tree.unflatten(treedef, items),
                restore_args=jax.tree.unflatten(treedef, args),
                partial_restore=partial,
            )
        ),
    )["state"]
    return jax.tree.unflatten(treedef, jax.tree.leaves(restored))


def _count_everywhere(flag: bool) -> int:
    """How many processes passed `flag` (each process calls this in the same order)."""
    if jax.process_count() == 1:
        return int(flag)
    from jax.experimental import multihost_utils

    return int(np.sum(multihost_utils.process_allgather(np.int32(flag))))


def _skip(step_dir: Path, error: Exception, quarantine: Path | None, skipped: list[str]) -> None:
    skipped.append(step_dir.name)
    where = ""
    if quarantine is not None and jax.process_index() == 0:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        target = quarantine / f"{step_dir.name}-{stamp}"
        quarantine.mkdir(parents=True, exist_ok=True)
        shutil.move(str(step_dir), str(target))
        where = f"; moved to {target}"
    log.warning(
        "checkpoint %s is incomplete or corrupt, skipping it (%s)%s",
        step_dir,
        first_cause_line(error),
        where,
    )


def saved_config(path: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """(step, config dict) of the newest checkpoint under `path` whose config item reads.

    `path` is a run folder, its checkpoints folder, or one step's folder. Raises CheckpointError
    when there is none.
    """
    import orbax.checkpoint as ocp

    location = parameters.locate(path)
    if location is not None:  # a parameters-only checkpoint (<root>/<step>/items)
        saved = parameters.read_config(location)
        if saved is None:
            raise ConfigError(
                f"{location.item_dir} has no saved config; give the model keys on the command line"
            )
        return location.step, saved
    directory, step = find_step_dir(path)
    if not directory.is_dir():
        raise CheckpointError(f"{path} does not exist")
    manager = _open_manager(directory, None, read_only=True)
    try:
        steps = [step] if step is not None else sorted(manager.all_steps(), reverse=True)
        for s in steps:
            try:
                check_files(directory / str(s), ("config",), state=False)
                got = manager.restore(s, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
                return s, got["config"]
            except Exception as e:  # noqa: BLE001 (storage errors only, see is_storage_error)
                if not is_storage_error(e):
                    raise
                log.warning("checkpoint %s is unreadable, skipping it (%s)", directory / str(s), e)
    finally:
        manager.close()
    raise CheckpointError(f"no readable checkpoint in {directory}")


def load_params(
    path: str | os.PathLike, abstract_params: Any, config: Config
) -> tuple[Any, Restored]:
    """The `params` of the newest readable checkpoint under `path` (see `saved_config`), as numpy
    arrays in the tree of `abstract_params` (scanned or unrolled: read from the canonical tree)."""
    layout = CanonicalLayout(abstract_params)
    canonical, restored = read_params(path, layout.abstract, config, shardings=None)
    leaves = jax.tree.leaves(canonical)
    by_leaf = layout.from_canonical(leaves, range(len(leaves)), numpy_stack)
    return jax.tree.unflatten(layout.treedef, [by_leaf[j] for j in sorted(by_leaf)]), restored


def read_params(
    path: str | os.PathLike, canonical_params: Any, config: Config, shardings: Any = None
) -> tuple[Any, Restored]:
    """The canonical `params` tree of the newest readable checkpoint under `path`.

    With `shardings` (one per leaf) they are placed as global arrays; without, they are numpy
    arrays. `path` may also be a parameters-only checkpoint (`parameters.py`: `OUT/0/items`).
    """
    location = parameters.locate(path)
    if location is not None:
        return _read_parameters_only(location, canonical_params, config, shardings)
    directory, step = find_step_dir(path)
    if not directory.is_dir():
        raise CheckpointError(f"{path} does not exist")
    manager = _open_manager(directory, None, read_only=True)
    try:
        restored = restore_latest(
            manager,
            directory,
            {"params": canonical_params},
            list(shardings) if shardings is not None else [],
            config=config,
            step=step,
            json_items=("config",),
            partial=True,
            restore_as_numpy=shardings is None,
        )
    finally:
        manager.close()
    if restored is None:
        raise CheckpointError(f"{path} holds no checkpoint")
    return restored.state["params"], restored


def _read_parameters_only(
    location: parameters.Location, canonical_params: Any, config: Config | None, shardings: Any
) -> tuple[Any, Restored]:
    saved = parameters.read_config(location)
    step_dir = location.root / str(location.step)
    if saved is not None and config is not None:
        _check_model(saved, config, step_dir)
    params = parameters.read_params(location, canonical_params, shardings)
    items = {"config": saved or {}}
    return params, Restored(location.step, step_dir, {"params": params}, items)


# ----------------------------------------------------------------------------------- the seams


def rng_item(config: Config) -> dict[str, Any]:
    """The run's randomness: everything (init, data order) derives from this seed and key."""
    key = jax.random.key(config.seed)
    return {
        "seed": config.seed,
        "impl": str(jax.random.key_impl(key)),
        "key_data": np.asarray(jax.random.key_data(key)).tolist(),
    }


class Checkpoints:
    """The loop's checkpoint seams for one run (see the module docstring)."""

    def __init__(self, config: Config, trainer: Any):
        self.config = config
        self.trainer = trainer
        self.directory = Path(config.checkpoint_dir).absolute()
        leaves, self._treedef = jax.tree.flatten(trainer.abstract_state)
        self._params_treedef = jax.tree.structure(trainer.abstract_state["params"])
        self._layout = CanonicalLayout(trainer.abstract_state)
        self._placement = placement_for(trainer, leaves)
        self._manager = None
        self.last_save_blocking_s: float | None = None
        if config.enable_checkpointing:
            logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save INFO lines
            self._manager = _open_manager(self.directory, config, read_only=False)

    def _state_leaves(self, canonical_leaves: list, indices: Sequence[int]) -> list:
        """Canonical leaves `indices` (as read) -> the state leaves they make, in state order."""
        sources = [self._layout.sources[c] for c in indices]
        placed = self._placement.place(canonical_leaves, sources)
        by_leaf = self._layout.from_canonical(placed, indices, self._placement.stack)
        return [by_leaf[j] for j in sorted(by_leaf)]

    # -- restore

    def restore_or_init(self, data: Any) -> Any:
        if self._manager is not None:
            restored = restore_latest(
                self._manager,
                self.directory,
                self._layout.abstract,
                self._placement.restore_shardings(self._layout.sources),
                config=self.config,
                quarantine=Path(self.config.output_dir).absolute() / CORRUPT_DIR,
            )
            if restored is not None:
                return self._resume(restored, data)
        if self.config.load_parameters_path:
            return self._load_parameters()
        return self.trainer.init_state()

    def _resume(self, restored: Restored, data: Any) -> Any:
        saved = restored.items["config"]
        rng = restored.items["rng"]
        if rng.get("key_data") != rng_item(self.config)["key_data"]:
            raise ConfigError(
                f"run {self.config.run_name} was trained with seed={rng.get('seed')}, now "
                f"seed={self.config.seed}; resume with seed={rng.get('seed')}, or start a new "
                f"run_name (load_parameters_path= keeps only the parameters)"
            )
        try:
            data.train.set_state(restored.items["data_iter"])
        except ValueError as e:
            raise ConfigError(
                f"checkpoint {restored.directory} cannot continue with this data: {e}; use the "
                f"same data keys, or load_parameters_path= in a new run"
            ) from None
        leaves = jax.tree.leaves(restored.state)
        state = jax.tree.unflatten(self._treedef, self._state_leaves(leaves, range(len(leaves))))
        changed = [
            f"{k} {saved.get(k)} -> {getattr(self.config, k)}"
            for k in LAYOUT_KEYS
            if k in saved and saved[k] != getattr(self.config, k)
        ]
        ignored = (
            "; load_parameters_path ignored (the run has its own checkpoints)"
            if self.config.load_parameters_path
            else ""
        )
        log.info(
            "resuming run %s from checkpoint step %d (%s)%s%s",
            self.config.run_name,
            restored.step,
            restored.directory,
            f"; layout changed: {', '.join(changed)}" if changed else "",
            ignored,
        )
        return state

    def _load_parameters(self) -> Any:
        indices = self._param_indices()
        loaded, restored = read_params(
            self.config.load_parameters_path,
            self._layout.abstract["params"],
            self.config,
            shardings=self._placement.restore_shardings([self._layout.sources[c] for c in indices]),
        )
        params = self._state_leaves(jax.tree.leaves(loaded), indices)
        state = self.trainer.init_state()  # fresh optimizer state and step 0
        state = {**state, "params": jax.tree.unflatten(self._params_treedef, params)}
        log.info(
            "new run %s starts from the parameters of checkpoint step %d (%s)",
            self.config.run_name,
            restored.step,
            restored.directory,
        )
        return state

    def _param_indices(self) -> list[int]:
        """Positions of the `params` leaves among the canonical tree's leaves."""
        flat = jax.tree_util.tree_flatten_with_path(self._layout.abstract)[0]
        return [i for i, (path, _) in enumerate(flat) if getattr(path[0], "key", None) == "params"]

    # -- save

    def should_save(self, step: int, final: bool) -> bool:
        return self._manager is not None and (final or step % self.config.checkpoint_period == 0)

    def maybe_save(self, step: int, state: Any, data: Any, final: bool) -> None:
        import orbax.checkpoint as ocp

        if not self.should_save(step, final):
            return
        if step in self._manager.all_steps():
            return  # already written (e.g. the run resumed exactly there)
        get_state = getattr(data.train, "get_state", None)
        if get_state is None:
            raise TypeError(
                "enable_checkpointing=true needs a training iterator with get_state()/set_state()"
            )
        tree = self._layout.to_canonical(self._placement.saveable(jax.tree.leaves(state)))
        t0 = time.perf_counter()
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(tree),
                data_iter=ocp.args.JsonSave(get_state()),
                rng=ocp.args.JsonSave(rng_item(self.config)),
                config=ocp.args.JsonSave({"format": FORMAT_VERSION, **self.config.to_dict()}),
            ),
            force=True,
        )
        self.last_save_blocking_s = time.perf_counter() - t0
        log.info(
            "checkpoint step %d -> %s (%s, %.2f s blocking)",
            step,
            self.directory / str(step),
            "async" if self.config.async_checkpointing else "written",
            self.last_save_blocking_s,
        )

    def wait(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None
