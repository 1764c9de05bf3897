"""Checkpoints: save during training, resume by `run_name`, start from another run's parameters.

One orbax `CheckpointManager` per run, under `{base_output_directory}/{run_name}/checkpoints/`:

    checkpoints/<step>/state/      {"step", "params", "opt_state"}: orbax PyTree (OCDBT + zarr)
                      /data_iter/  the training iterator's position (JSON, `data.train.get_state()`)
                      /rng/        the seed and PRNG key the run derives its randomness from (JSON)
                      /config/     every key and derived value of the config that wrote it (JSON)

The loop (`MaxText/train.py`) talks to one `Checkpoints` object:

- `restore_or_init(data)` -> the state to start from: the latest complete, readable checkpoint of
  this run (and the data iterator moved to its position), else the parameters of
  `load_parameters_path` with step 0 and the optimizer's initial state (each leaf made where the
  step reads it, no random initialisation), else a fresh state. Logs one line naming the step.
- `maybe_save(step, state, data, final)` saves every `checkpoint_period` steps and at the last step;
  with `async_checkpointing` the arrays are copied to host memory, then written by a background
  thread while training continues; the next save (and `close()`) waits for the previous one.
  `save(step, state, data, wait=True)` saves now and returns once it is on disk (preemption).
- `check()` (every step) reports a failed background save; `close()` waits for a pending save and
  releases the manager.

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
only when every item is written (and its `checksums.json` recorded), so a killed save never looks
complete; leftover temporary folders are removed when the next run opens the manager. Before a
checkpoint is restored every file is checked against its checksum (older checkpoints without a
record: every stored array chunk is read once) and its metadata files are parsed (`integrity.py`;
the walk over the steps is `restore.py`). A damaged checkpoint (missing, truncated or altered
file) is skipped with a warning naming it, moved to `{run}/checkpoints_corrupt/` (so the step can
be written again), and the previous one is used. A checkpoint that cannot be read for another
storage reason (permission denied, EIO, ...) is not damaged: the run stops with one line
(`CheckpointUnavailableError`, exit 1) and nothing is moved. Any other exception is a bug,
propagates with its traceback and moves nothing. A save that fails (disk full, permission) stops
the run with one line naming the step, the errno and the newest checkpoint on disk
(`PendingSave`, `StorageError`, exit 1); an async save's failure is found at the next step
(`check`). The step's folders are made in `save()` itself, before the background writes start:
a folder that cannot be made fails `save()`, and no background thread is left waiting for it
(orbax's commit threads would wait for a "folders made" signal for its 5-minute coordination
timeout, keeping the process alive after its one-line error).

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

import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.checkpoint import parameters
from MaxText.checkpoint.integrity import (
    UNAVAILABLE,
    CheckpointUnavailableError,
    UnreadableCheckpointError,  # noqa: F401 (part of this module's interface)
    check_files,
    classify,
    describe_failure,
    is_storage_error,  # noqa: F401 (part of this module's interface)
)
from MaxText.checkpoint.layout import CanonicalLayout, numpy_stack, placement_for
from MaxText.checkpoint.pending_save import PendingSave, quiet_abandoned_writes
from MaxText.checkpoint.restore import (
    Restored,
    check_model,
    restore_latest,
)
from MaxText.config import Config, ConfigError
from MaxText.errors import CheckpointError, StorageError

# orbax is imported where it is used: importing it logs through absl, which installs a root log
# handler when there is none yet and so would swallow the trainer's `logging.basicConfig`.

log = logging.getLogger(__name__)

# 2: scanned runs store every layer as `layers_<i>` (format 1 stored them stacked under `layers`).
FORMAT_VERSION = 2
ITEMS = ("state", "data_iter", "rng", "config")
CORRUPT_DIR = "checkpoints_corrupt"

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


def _open_manager(
    directory: str | os.PathLike,
    config: Config | None,
    read_only: bool,
    on_written: Any = None,
):
    """orbax's manager for `directory`. Writing managers always save through orbax's background
    thread (`async_checkpointing=false` waits for it at once), so `on_written` runs in every
    save after every item is written and before the step is made visible (checksums)."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else config.max_num_checkpoints_to_keep,
        save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=not read_only,
        async_options=None
        if read_only
        else ocp.AsyncOptions(
            post_finalization_callback=on_written,
            # The step's folders are made in save() itself, not by a background future that the
            # writing threads wait on: when making them fails, those threads would wait for a
            # signal that never comes, for orbax's coordination timeout (5 minutes), and the
            # process could not exit before (they are not daemon threads).
            create_directories_asynchronously=False,
        ),
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


def _require_folder(path: str | os.PathLike, directory: Path) -> None:
    """A checkpoint path must be a folder: say which kind of path it is when it is not."""
    if Path(path).is_file():
        raise CheckpointError(
            f"{path} is a file; give a run folder, its checkpoints folder or one step's folder"
        )
    if not directory.is_dir():
        raise CheckpointError(f"{path} does not exist")


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
    _require_folder(path, directory)
    manager = _open_manager(directory, None, read_only=True)
    try:
        steps = [step] if step is not None else sorted(manager.all_steps(), reverse=True)
        for s in steps:
            try:
                check_files(directory / str(s), ("config",), state=False)
                got = manager.restore(s, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
                return s, got["config"]
            except Exception as e:  # noqa: BLE001 (storage errors only, see integrity.classify)
                kind = classify(e)
                if kind is None:
                    raise
                if kind == UNAVAILABLE:
                    raise CheckpointUnavailableError(
                        f"cannot read checkpoint {directory / str(s)}: {describe_failure(e)}; "
                        f"fix the storage or its permissions and run again"
                    ) from None
                log.warning("checkpoint %s is unreadable, skipping it (%s)", directory / str(s), e)
    finally:
        manager.close()
    raise CheckpointError(f"no readable checkpoint in {directory}")


# Where orbax's JSON handler puts a step's `config` item (`<step>/config/metadata`); read directly
# by `check_model_before_compiling`, which degrades to the restore's check if the layout changes.
_CONFIG_FILE = ("config", "metadata")


def check_model_before_compiling(config: Config) -> None:
    """The checkpoint the run will start from holds this config's model, or a `ConfigError`
    (exit 2) before anything is compiled or written: the run's own newest checkpoint with a
    saved config (with `enable_checkpointing`), else `load_parameters_path`'s.

    It reads this process's view of the files directly (no orbax manager, nothing exchanged
    between processes, so each process may run it alone), and a checkpoint without a readable
    config is left to the restore, which checks the model again (`restore.check_model`) and
    reports damage as it finds it."""
    paths = [Path(config.checkpoint_dir)] if config.enable_checkpointing else []
    if config.load_parameters_path:
        paths.append(Path(config.load_parameters_path))
    for path in paths:
        found = _newest_saved_config(path)
        if found is not None:
            check_model(found[1], config, found[0])
            return


def _newest_saved_config(path: Path) -> tuple[Path, dict[str, Any]] | None:
    """(step folder, saved config) of the newest step under `path` whose config reads as JSON."""
    if not path.is_dir():
        return None
    location = parameters.locate(path)
    if location is not None:  # a parameters-only checkpoint: its config file, if it has one
        with contextlib.suppress(CheckpointError, OSError):
            saved = parameters.read_config(location)
            return None if saved is None else (location.root / str(location.step), saved)
        return None
    directory, step = find_step_dir(path)
    if step is None:
        names = (p.name for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else ()
        steps = sorted((int(n) for n in names if n.isdigit()), reverse=True)
    else:
        steps = [step]
    for s in steps:
        with contextlib.suppress(OSError, ValueError):
            config_file = directory.joinpath(str(s), *_CONFIG_FILE)
            return directory / str(s), json.loads(config_file.read_text())
    return None


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
    _require_folder(path, directory)
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
            none_readable=(
                f"{path} belongs to another run, so nothing was moved; point "
                f"load_parameters_path at a readable checkpoint (a run folder, its checkpoints "
                f"folder or one step's folder)"
            ),
        )
    finally:
        manager.close()
    if restored is None:
        raise CheckpointError(f"{path} holds no checkpoint")
    return restored.state["params"], restored


def _read_parameters_only(
    location: parameters.Location, canonical_params: Any, config: Config | None, shardings: Any
) -> tuple[Any, Restored]:
    parameters.verify(location)  # damage: one line naming the file, before orbax reads it
    saved = parameters.read_config(location)
    step_dir = location.root / str(location.step)
    if saved is not None and config is not None:
        check_model(saved, config, step_dir)
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


def initial_state_leaves(abstract_state: Any, optimizer: Any) -> Any:
    """A function of nothing (to trace) giving every leaf of a new run's state in
    `abstract_state`'s order: step 0, zero parameters, and the optimizer's initial state of them.
    The optimizers' initial states depend on the parameters' shapes only (zero moments, zero
    counts: tests/test_fine_tune_state.py checks every `opt_type` against `optimizer.init` of
    random parameters), so a fine-tune's optimizer state comes from here."""
    treedef = jax.tree.structure(abstract_state)

    def leaves() -> list:
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_state["params"])
        state = {"step": jnp.zeros((), jnp.int32), "params": zeros}
        out, made = jax.tree.flatten({**state, "opt_state": optimizer.init(zeros)})
        if made != treedef:
            raise TypeError(f"the optimizer's state is not the trainer's: {made} != {treedef}")
        return out

    return leaves


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
        self.pending = PendingSave(self.directory)
        self.last_save_blocking_s: float | None = None
        if config.enable_checkpointing:
            # orbax's per-save INFO lines, and its own tracebacks of a failed write (reported in
            # one line by `PendingSave`) unless debug_tracebacks
            level = logging.WARNING if config.debug_tracebacks else logging.CRITICAL
            logging.getLogger("absl").setLevel(level)
            if not config.debug_tracebacks:
                quiet_abandoned_writes()
                # orbax's event loops: its abandoned writes' exceptions, logged when collected
                logging.getLogger("asyncio").setLevel(logging.CRITICAL)
            self._manager = _open_manager(
                self.directory, config, read_only=False, on_written=self.pending.record_checksums
            )
            self.pending.manager = self._manager

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

    def starting_params(self) -> Any:
        """The parameters a new run of this config starts from, laid out like a fresh state's:
        `load_parameters_path`'s, else the initial ones (DPO's frozen reference model, read again
        when a run resumes)."""
        if not self.config.load_parameters_path:
            return self.trainer.init_state()["params"]
        loaded, _ = self._read_parameters()
        return loaded

    def _read_parameters(self) -> tuple[Any, Restored]:
        indices = self._param_indices()
        loaded, restored = read_params(
            self.config.load_parameters_path,
            self._layout.abstract["params"],
            self.config,
            shardings=self._placement.restore_shardings([self._layout.sources[c] for c in indices]),
        )
        params = self._state_leaves(jax.tree.leaves(loaded), indices)
        return jax.tree.unflatten(self._params_treedef, params), restored

    def _load_parameters(self) -> Any:
        params, restored = self._read_parameters()
        state = self._state_around(params)
        log.info(
            "new run %s starts from the parameters of checkpoint step %d (%s)",
            self.config.run_name,
            restored.step,
            restored.directory,
        )
        return state

    def _state_around(self, params: Any) -> Any:
        """A new run's state holding `params`: step 0 and the optimizer's initial state, each
        leaf made on the devices the step reads it from (`make`), with no random initialisation
        (a pipelined `init_state()` makes the whole state on the first group: for Llama 2 70B at
        pp=8 x fsdp=8 more than an H100 holds, benchmarks/results/init_memory.json)."""
        abstract = self.trainer.abstract_state
        is_param = [
            getattr(path[0], "key", None) == "params"
            for path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]
        ]
        others = [j for j, p in enumerate(is_param) if not p]
        values = initial_state_leaves(abstract, self.trainer.optimizer)
        made = dict(zip(others, self._placement.make(values, others), strict=True))
        loaded = iter(jax.tree.leaves(params))
        leaves = [next(loaded) if p else made[j] for j, p in enumerate(is_param)]
        return jax.tree.unflatten(self._treedef, leaves)

    def _param_indices(self) -> list[int]:
        """Positions of the `params` leaves among the canonical tree's leaves."""
        flat = jax.tree_util.tree_flatten_with_path(self._layout.abstract)[0]
        return [i for i, (path, _) in enumerate(flat) if getattr(path[0], "key", None) == "params"]

    # -- save

    def should_save(self, step: int, final: bool) -> bool:
        return self._manager is not None and (final or step % self.config.checkpoint_period == 0)

    def maybe_save(self, step: int, state: Any, data: Any, final: bool) -> None:
        if self.should_save(step, final):
            self.save(step, state, data)

    def save(self, step: int, state: Any, data: Any, wait: bool = False) -> None:
        """Saves `step` (see the module docstring); with `wait` (or `async_checkpointing=false`)
        returns once it is on disk. Raises StorageError (one line) when the storage fails."""
        import orbax.checkpoint as ocp

        self.pending.check()  # the previous save: a failure is reported as that step's
        if step in self._manager.all_steps():
            return  # already written (e.g. the run resumed exactly there)
        get_state = getattr(data.train, "get_state", None)
        if get_state is None:
            raise TypeError(
                "enable_checkpointing=true needs a training iterator with get_state()/set_state()"
            )
        tree = self._layout.to_canonical(self._placement.saveable(jax.tree.leaves(state)))
        t0 = time.perf_counter()
        try:
            self.pending.wait()  # orbax would wait inside save(): name the right step on failure
            self.pending.begin(step)
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
        except StorageError:
            raise
        except Exception as e:
            raise self.pending.failed(step, e) from e
        self.last_save_blocking_s = time.perf_counter() - t0
        written = wait or not self.config.async_checkpointing
        if written:
            self.pending.wait()
        log.info(
            "checkpoint step %d -> %s (%s, %.2f s blocking)",
            step,
            self.directory / str(step),
            "written" if written else "async",
            self.last_save_blocking_s,
        )

    def check(self) -> None:
        """Raises StorageError if the save in flight already failed (cheap; every step)."""
        if self._manager is not None:
            self.pending.check()

    def wait(self) -> None:
        """Waits for the save in flight; raises StorageError if it failed."""
        if self._manager is not None:
            self.pending.wait()

    def close(self) -> None:
        """Waits for a save in flight (StorageError if it failed) and releases orbax."""
        if self._manager is None:
            return
        try:
            self.pending.wait()
        finally:
            manager, self._manager = self._manager, None
            with contextlib.suppress(Exception):  # a failure was reported once already
                manager.close()

    def abandon(self) -> None:
        """Forgets orbax without waiting for a save in flight (the process exits at once; the
        next run removes the unfinished temporary folder)."""
        self._manager = None
