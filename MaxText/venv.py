"""Run an entry point under the project's `.venv` when the current python lacks the deps.

`python train.py ...` or `python -m MaxText.plan ...` with a system python (no activated `.venv`)
would stop at `import jax`. `ensure_dependencies()` runs first (standard library only): `train.py`
calls it itself, and `MaxText/__init__.py` calls it for every `python -m MaxText.<tool>` (the
package is imported before the tool's module). When a required package is missing
and `<repo>/.venv/bin/python` exists, it replaces the process with that interpreter and the same
command line (`os.execv`, so exit codes, signals and output are the script's own); when there is no
`.venv`, it prints one line saying to run `./setup.sh` and exits with 2. Under `.venv`'s python it
does nothing. A re-executed process that still lacks the packages (a broken `.venv`) says so
instead of looping.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Top-level packages the trainer imports (requirements.txt); the first missing one is named.
REQUIRED = ("jax", "flax", "optax", "orbax", "yaml", "numpy")
_REEXEC_MARK = "MAXTEXT_REEXEC_FROM"  # set in the re-executed process only, to stop a loop


def missing_package() -> str | None:
    for name in REQUIRED:
        if importlib.util.find_spec(name) is None:
            return name
    return None


def ensure_dependencies(repo: Path = REPO) -> None:
    missing = missing_package()
    if missing is None:
        return
    venv_python = repo / ".venv" / "bin" / "python"
    if os.environ.get(_REEXEC_MARK):
        print(
            f"error: {missing} is not installed in {venv_python}; run ./setup.sh first",
            file=sys.stderr,
        )
        sys.exit(2)
    if not venv_python.exists():
        print(
            f"error: {missing} is not installed for {sys.executable} and there is no "
            f"{repo / '.venv'}; run ./setup.sh first",
            file=sys.stderr,
        )
        sys.exit(2)
    # sys.orig_argv keeps interpreter options and `-m module` as typed; the script path is the
    # one the user gave, relative to the unchanged working directory.
    argv = [str(venv_python), *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(str(venv_python), argv, {**os.environ, _REEXEC_MARK: sys.executable})
