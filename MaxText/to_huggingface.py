"""Export a checkpoint as a Hugging Face Llama folder (config.json, safetensors, tokenizer).

    python -m MaxText.to_huggingface configs/base.yml load_parameters_path=CKPT hf_output_path=DIR \
        [hf_output_dtype=bfloat16|float32] [hf_max_shard_mb=5000]
    python -m MaxText.to_huggingface configs/base.yml run_name=<run> hf_output_path=DIR

CKPT: a converted `OUT/0/items` (or `OUT`), a run folder, its checkpoints folder or one step's
folder; with `run_name=` the run's newest checkpoint. The model keys come from the checkpoint.
Streams one layer at a time. How: `MaxText/convert/exporter.py`. Exit code 2 with one line for a
config error.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """Entry point; returns the exit code (`MaxText/exit_codes.py`)."""
    from MaxText import exit_codes
    from MaxText.config import tool_help

    if (words := tool_help.requested(argv)) is not None:  # --help [WORD]: usage and keys
        return tool_help.show("MaxText.to_huggingface", words)
    from MaxText.metrics import setup_logging

    setup_logging()
    return exit_codes.run(lambda: _export(argv))


def _export(argv: Sequence[str]) -> int:
    from MaxText.cluster.output_paths import writable_dir
    from MaxText.convert import exporter

    config = exporter.export_config(argv)
    writable_dir(config.hf_output_path, "hf_output_path")  # before reading the checkpoint
    exporter.export(config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
