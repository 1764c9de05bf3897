"""The trainer's user-facing error types, shared by every module that validates user input.

`ConfigError`: a configuration or device-setting problem the user can fix; its message is one line
(what is wrong and how to fix it). `train.py` prints it as `config error: ...` and exits with 2.
It lives here, not in `config.py`, so that modules `config.py` itself uses (`devices.py`) can raise
it without importing the config.

`PathError`: a path the run must write or read is unusable (a read-only or missing folder, a
regular file where a folder is needed); found before anything is compiled; exit 2.
`StorageError`: the storage failed while the run was going (disk full, permission or I/O error
while saving, or while reading a checkpoint that is not damaged); its message names the path,
the errno and the newest checkpoint on disk; exit 1.

Each type carries its `label` (the word before the colon of the printed line) and `exit_code`;
`MaxText/exit_codes.py` prints and maps them alike in every entry point.
"""


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message is one line."""

    label = "config error"
    exit_code = 2


class PathError(ValueError):
    """An output or input path that cannot be used as given; the message is one line."""

    label = "path error"
    exit_code = 2


class StorageError(RuntimeError):
    """The storage failed during a run (ENOSPC, EACCES, EIO, ...); the message is one line."""

    label = "I/O error"
    exit_code = 1
