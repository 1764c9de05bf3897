"""Train a decoder LLM: `python train.py configs/base.yml [key=value ...]` (MaxText/train.py).

Any python works: without the dependencies it re-runs itself under `.venv/bin/python`
(`MaxText/venv.py`), or says to run `./setup.sh` first.
"""

import sys

from MaxText.venv import ensure_dependencies

if __name__ == "__main__":
    ensure_dependencies()
    from MaxText.train import main

    sys.exit(main(sys.argv[1:]))
