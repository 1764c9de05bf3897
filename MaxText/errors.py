"""The trainer's user-facing error types, shared by every module that checks what the user gave.

`UserError`: a problem the user can fix (a setting, a path, a checkpoint); its message is one line
saying what is wrong and how to fix it, and the entry points print it as `<prefix>: <message>` and
exit with code 2. Each kind has its own prefix, so the user reads what kind of thing to fix:

- `ConfigError` ("config error"): a key, a combination of keys, or a device setting;
- `CheckpointError` ("checkpoint error"): a checkpoint that is missing or cannot be read.

They live here, below the config, so that any package can raise them without importing the config.
"""


class UserError(ValueError):
    """A problem the user can fix; the message is one line. `prefix` names its kind."""

    prefix = "error"


class ConfigError(UserError):
    """A configuration problem the user can fix."""

    prefix = "config error"


class CheckpointError(UserError):
    """A checkpoint that is missing or unreadable (not a disagreement with the config's keys)."""

    prefix = "checkpoint error"
