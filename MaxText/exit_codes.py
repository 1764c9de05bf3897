"""Exit codes: the one table every entry point follows, and the one-line report of an error.

| code  | meaning                                                                             |
|-------|-------------------------------------------------------------------------------------|
| 0     | success                                                                             |
| 1     | the run failed: loss diverged, storage failed during the run, a plan does not fit   |
| 2     | user error found before the work starts: config, data, path, usage                 |
| 3     | hang watchdog (`pipeline_hang_timeout_s`): a peer process stopped answering         |
| 128+N | stopped after handling signal N: 143 for SIGTERM, 130 for SIGINT (Ctrl-C)           |

`train.py`, `python -m MaxText.plan`, `MaxText.generate`, `MaxText.launch` and
`MaxText.data.prepare`, `MaxText.to_maxtext` and `MaxText.to_huggingface` follow it
(`tests/test_exit_codes.py` runs each). A new tool wraps its body in `run(...)`: an error type that
carries `prefix` and `exit_code` class attributes (every `UserError`: `ConfigError`,
`CheckpointError`, `PathError`; `DataError`; `StorageError`, ...) is printed as one line
`<prefix>: <first line of the message>` on stderr and its code returned; Ctrl-C outside a handled
loop is one line and 130; any other exception is a bug and keeps its traceback. A tool's flags are
parsed by `ArgumentParser`, whose usage errors are one line too (exit 2).

This module is standard library only, so every layer of the trainer can use it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from collections.abc import Callable

OK = 0
RUN_FAILURE = 1
USER_ERROR = 2
HANG = 3  # jaxpp_integration.runtime.watchdog.HANG_EXIT_CODE (tests/test_exit_codes.py checks)


def after_signal(signum: int) -> int:
    """The exit code of a process that stopped after handling signal `signum`."""
    return 128 + int(signum)


def from_returncode(returncode: int) -> int:
    """A child's `Popen.returncode` in this table: -N (killed by signal N) -> 128 + N."""
    return after_signal(-returncode) if returncode < 0 else returncode


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def exit_code_of(e: BaseException) -> int | None:
    """The table's code for a user-facing error type, None for anything else (a bug)."""
    code = getattr(type(e), "exit_code", None)
    return code if isinstance(code, int) and getattr(type(e), "prefix", None) else None


def report(e: BaseException, *, debug: bool = False) -> int | None:
    """Prints `<prefix>: <message>` (one line, stderr) for a user-facing error; returns its code.

    With `debug` the traceback is printed first. Returns None (printing nothing) for other
    exceptions, which the caller re-raises.
    """
    code = exit_code_of(e)
    if code is None:
        return None
    if debug:
        traceback.print_exception(e)
    print(f"{type(e).prefix}: {first_line(e)}", file=sys.stderr, flush=True)
    return code


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (`usage error: <what>; see <prog>
    --help`) and exit code 2, instead of argparse's usage block."""

    def error(self, message: str):
        print(f"usage error: {message}; see {self.prog} --help", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR)


def run(body: Callable[[], int], *, debug: bool = False) -> int:
    """Runs a tool's `body` and turns the errors of the table into their one line and code."""
    try:
        return body()
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return after_signal(signal.SIGINT)
    except Exception as e:
        code = report(e, debug=debug)
        if code is None:
            raise
        return code
