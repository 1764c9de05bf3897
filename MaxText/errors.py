"""The trainer's user-facing error types, shared by every module that checks what the user gave.

`UserError`: a problem the user can fix (a setting, a path, a checkpoint); its message is one line
saying what is wrong and how to fix it, and the entry points print it as `<prefix>: <message>` and
exit with code 2. Each kind has its own prefix, so the user reads what kind of thing to fix:

- `ConfigError` ("config error"): a key, a combination of keys, or a device setting;
- `CheckpointError` ("checkpoint error"): a checkpoint that is missing or cannot be read;
- `PathError` ("path error"): a path the run must write or read is unusable (a read-only or
  missing folder, a regular file where a folder is needed); found before anything is compiled.

`StorageError` ("I/O error") is not the user's input but the storage failing while the run goes
(disk full, permission or I/O error while saving, or while reading a checkpoint that is not
damaged); its message names the path, the errno and the newest checkpoint on disk; exit 1.

Every type carries its `prefix` and `exit_code`; `MaxText/exit_codes.py` prints and maps them
alike in every entry point. They live here, below the config, so that any package can raise them
without importing the config.
"""


class UserError(ValueError):
    """A problem the user can fix; the message is one line. `prefix` names its kind."""

    prefix = "error"
    exit_code = 2


class ConfigError(UserError):
    """A configuration problem the user can fix."""

    prefix = "config error"


class CheckpointError(UserError):
    """A checkpoint that is missing or unreadable (not a disagreement with the config's keys)."""

    prefix = "checkpoint error"


class PathError(UserError):
    """An output or input path that cannot be used as given."""

    prefix = "path error"


class StorageError(RuntimeError):
    """The storage failed during a run (ENOSPC, EACCES, EIO, ...); the message is one line."""

    prefix = "I/O error"
    exit_code = 1
