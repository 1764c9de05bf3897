"""A MaxText-style decoder-LLM trainer on JAX/flax, with MPMD pipeline parallelism via jaxpp.

Data flows one way: `config` -> `devices`/`sharding` (mesh) -> `model` -> `train_step` -> `train`
(the loop) -> checkpoints / `metrics`.

Every `python -m MaxText.<tool>` imports this package before the tool's module, so this is where
such a command re-runs itself under the project's `.venv` when the python it was started with lacks
the dependencies (`MaxText.venv`), before anything imports jax. A new tool needs nothing of its
own for it. While `-m` locates its module, Python sets `sys.argv[0]` to "-m"; any other import of
this package (a library user, tests, `python train.py`) leaves it alone.
"""

import sys as _sys

if _sys.argv[:1] == ["-m"]:
    from MaxText.venv import ensure_dependencies as _ensure_dependencies

    _ensure_dependencies()
