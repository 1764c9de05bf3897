"""The trainer's user-facing error type, shared by every module that validates user input.

`ConfigError`: a configuration or device-setting problem the user can fix; its message is one line
(what is wrong and how to fix it). `train.py` prints it as `config error: ...` and exits with 2.
It lives here, not in `config.py`, so that modules `config.py` itself uses (`devices.py`) can raise
it without importing the config.
"""


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message is one line."""
