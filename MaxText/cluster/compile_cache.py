"""JAX's persistent compilation cache for the trainer and the planner (`jax_cache_dir`).

A pipelined step is many XLA programs (one per distinct task, plus the work before and after the
loop), and the planner and the trainer's `auto` keys compile several variants of one step: the
even split and the balanced one, remat policies per stage, then the trainer's own step. Most of
their programs are identical (the optimizer's after-loop programs, the embedding, a stage whose
policy and layer count did not change), and JAX's persistent compilation cache turns every
repeat into a read of the executable compiled first.

- `jax_cache_dir=<dir>` (MaxText's key): executables persist in `<dir>` across runs, so a
  restarted or resumed run, or a plan re-run with one key changed, skips the compiles it has
  seen: a restart of a one-process pipelined run compiles nothing at all (the engine loads the
  programs groups share from the bytes read, `jaxpp_integration/compiler/compile.py`). JAX keys
  each entry by the program, the compiler flags and the devices, so a stale entry is never
  used, and writes entries from process 0 only; the directory is never pruned (delete it at
  will).
- `jax_cache_dir=""` (default): a temporary directory for this run only, removed at exit, unless
  JAX's cache is already configured (`JAX_COMPILATION_CACHE_DIR`), which is then used as is.

Every program is cached whatever its compile time (JAX's default skips those under a second,
which a pipeline's many small task programs mostly are), and written whole (a temporary file
renamed into place), so runs sharing a `jax_cache_dir` never read an entry still being written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from jaxpp_integration.jax_compat import atomic_persistent_cache_writes, reset_compilation_cache

_SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@contextlib.contextmanager
def compilation_cache(directory: str = ""):
    """JAX's persistent compilation cache in `directory` while the block runs ("" = the one JAX
    is configured with, else a temporary directory), then JAX's previous settings again."""
    import jax

    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    temporary = None
    if directory:
        directory = os.path.expanduser(directory)
        os.makedirs(directory, exist_ok=True)
    elif before["jax_compilation_cache_dir"]:
        directory = before["jax_compilation_cache_dir"]
    else:
        directory = temporary = tempfile.mkdtemp(prefix="maxtext_jax_cache_")
    atomic_persistent_cache_writes()
    try:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        reset_compilation_cache()
        yield directory
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        reset_compilation_cache()
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
