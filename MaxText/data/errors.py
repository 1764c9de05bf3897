"""The data pipeline's user-facing error types: a data setting the user can fix.

`DataError` is a `UserError` (a `ValueError`) whose message is one line naming the setting (or
the file) and the fix; every entry point prints it as `data error: ...` and exits with code 2
(`prefix`, `exit_code`: see `MaxText/exit_codes.py`), as for config errors. The subclasses keep
the built-in type a caller may already catch (a missing file is still a `FileNotFoundError`, a
missing optional package still an `ImportError`).
"""

from __future__ import annotations

from MaxText.errors import UserError


class DataError(UserError):
    """A data setting (path, dataset, tokenizer, split) or data file that cannot be used."""

    prefix = "data error"
    exit_code = 2


class DataNotFoundError(DataError, FileNotFoundError):
    """A file, folder or dataset named by a data setting does not exist."""


class DataImportError(DataError, ImportError):
    """A data setting needs an optional package that is not installed."""
