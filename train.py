"""Train a decoder LLM: `python train.py configs/base.yml [key=value ...]` (MaxText/train.py)."""

import sys

from MaxText.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
