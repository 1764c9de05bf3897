"""Convert a Hugging Face Llama checkpoint into a parameters checkpoint for `load_parameters_path`.

    python -m MaxText.to_maxtext configs/base.yml [model_name=<preset>] hf_model_path=DIR \
        base_output_directory=OUT [weight_dtype=float32|bfloat16]

Writes `OUT/0/items` (and `OUT/0/config`, the model keys), streaming one tensor at a time; then
`python train.py configs/base.yml load_parameters_path=OUT/0/items ...` trains from it in any
layout. How: `MaxText/convert/importer.py`. Exit code 2 with one line for anything it cannot
convert (another architecture, a missing tensor, shapes that do not match `model_name=`) or an
output folder that cannot be written (`MaxText/exit_codes.py`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """Entry point; returns the exit code (`MaxText/exit_codes.py`)."""
    from MaxText import exit_codes
    from MaxText.config import tool_help

    if (words := tool_help.requested(argv)) is not None:  # --help [WORD]: usage and keys
        return tool_help.show("MaxText.to_maxtext", words)
    from MaxText.metrics import setup_logging

    setup_logging()
    return exit_codes.run(lambda: _convert(argv))


def _convert(argv: Sequence[str]) -> int:
    from MaxText.checkpoint.parameters import check_new_step
    from MaxText.cluster.output_paths import creatable_dir
    from MaxText.convert import importer
    from MaxText.convert.checks import load_checked_tokenizer

    config, folder = importer.import_config(argv)
    load_checked_tokenizer(config)  # the tokenizer the checkpoint will record
    out = creatable_dir(config.base_output_directory, "base_output_directory")  # nothing made
    check_new_step(out, 0)
    importer.convert(config, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
