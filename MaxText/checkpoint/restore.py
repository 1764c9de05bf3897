"""Restoring from one run's checkpoints folder: the newest checkpoint every process can read.

`restore_latest(manager, directory, abstract_tree, shardings, ...)` walks the steps newest first.
For each it checks the files against their checksums (`integrity.verify_checksums`; without a
record, every stored chunk is read once), reads the JSON items, checks the saved model against the
config (`check_model`: a different model is a `ConfigError`), and reads the `state` item onto the
requested shardings. What a failure means is decided by `integrity.classify`, and agreed by all
processes (`_gather`):

- damaged on some process: skipped with a warning naming the file; moved to `quarantine`
  (`<run>/checkpoints_corrupt/`) only when no process could read it; the previous step is tried;
- unavailable (permission, I/O) on any process: `CheckpointUnavailableError` (exit 1), nothing
  skipped or moved;
- anything else: a bug, raised with its traceback, nothing moved.

No readable step at all is a `CheckpointError` ending with the caller's advice (`none_readable`).
`MaxText/checkpoint/manager.py` uses it for a run's own checkpoints and for `load_parameters_path`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from MaxText.checkpoint.integrity import (
    UNAVAILABLE,
    CheckpointUnavailableError,
    check_files,
    classify,
    describe_failure,
    first_cause_line,
    verify_arrays,
    verify_checksums,
)
from MaxText.checkpoint.layout import restore_args
from MaxText.config import Config, ConfigError
from MaxText.config.checkpoint_keys import SHAPE_KEYS
from MaxText.errors import CheckpointError, UserError

log = logging.getLogger(__name__)


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
    none_readable: str = "move the folder away to start the run from scratch",
) -> Restored | None:
    """Reads the newest readable checkpoint of `manager` (or exactly `step`).

    `abstract_tree` gives the structure and shapes to read from the `state` item (all of it, or
    with `partial` a sub-tree such as `{"params": ...}`); `shardings` one sharding per leaf.
    Damaged checkpoints are skipped with a warning (and moved to `quarantine` if given).
    Returns None when there is no checkpoint at all; raises CheckpointError (ending with the
    advice `none_readable`) when none is readable, ConfigError when the checkpoint holds a
    different model than `config`, and CheckpointUnavailableError, moving nothing, when a
    checkpoint cannot be read for a reason that is not damage (permission, I/O: see
    `integrity.classify`).
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
        status = _READ
        try:
            checked = verify_checksums(step_dir)
            meta = _read_json(manager, s, step_dir, json_items)
            if config is not None and "config" in meta:
                check_model(meta["config"], config, step_dir)
            state = _read_state(manager, s, step_dir, treedef, items, args, partial, checked)
            restored = Restored(step=s, directory=step_dir, state=state, items=meta)
        except UserError:
            raise  # the same on every process: it holds another model
        except Exception as e:  # noqa: BLE001 (storage errors only, see integrity.classify)
            kind = classify(e)
            if kind is None:
                raise  # a bug, not a damaged checkpoint: nothing is skipped or moved
            error, status = e, (_UNAVAILABLE if kind == UNAVAILABLE else _DAMAGED)
        statuses = _gather(status)
        if _UNAVAILABLE in statuses:
            who = "" if jax.process_count() == 1 else f" (process {statuses.index(_UNAVAILABLE)})"
            reason = describe_failure(error) if status == _UNAVAILABLE else "on another process"
            raise CheckpointUnavailableError(
                f"cannot read checkpoint {step_dir}{who}: {reason}; it is not damaged, so "
                f"nothing was moved: fix the storage or its permissions and run again"
            )
        if all(x == _READ for x in statuses):
            if skipped:
                manager.reload()
            return restored
        if error is None:
            error = RuntimeError("another process could not read it")
        # Moved aside only when no process could read it (a checkpoint one process reads is not
        # corrupt: the others see another filesystem or failed for another reason).
        nobody = _READ not in statuses
        _skip(step_dir, error, quarantine if nobody else None, skipped)
    raise CheckpointError(
        f"no readable checkpoint in {directory} (skipped {', '.join(skipped)}); {none_readable}"
    )


_READ, _DAMAGED, _UNAVAILABLE = 0, 1, 2


def _read_json(manager, step: int, step_dir: Path, names: Sequence[str]) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    check_files(step_dir, names, state=False)
    got = manager.restore(
        step, args=ocp.args.Composite(**{k: ocp.args.JsonRestore() for k in names})
    )
    return {k: got[k] for k in names}


def check_model(saved: dict, config: Config, step_dir: Path) -> None:
    if saved.get("format", 1) < 2 and saved.get("scan_layers"):
        raise CheckpointError(
            f"checkpoint {step_dir} was written with scan_layers=true in checkpoint format 1 "
            f"(layers stacked on disk), which this version no longer reads; re-save it with the "
            f"version that wrote it, or start a new run_name"
        )
    wrong = [
        f"{k}={saved.get(k)!r} in the checkpoint vs {getattr(config, k)!r} now"
        for k in SHAPE_KEYS
        if saved.get(k) != getattr(config, k)
    ]
    if wrong:
        raise ConfigError(
            f"checkpoint {step_dir} holds a different model: {'; '.join(wrong)}; "
            f"use the same model keys or another run_name"
        )


def _read_state(manager, step, step_dir, treedef, items, args, partial: bool, checked: bool) -> Any:
    """The `state` item's arrays. Unless its files were `checked` against their checksums, every
    stored chunk is read once first (`verify_arrays`), so damage is one line, not orbax's noise."""
    import orbax.checkpoint as ocp

    check_files(step_dir, (), state=True)
    if not checked:
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


def _gather(value: int) -> list[int]:
    """`value` of every process, by process index (each process calls this in the same order)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int32(value)))]


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
