"""Export a checkpoint as a Hugging Face Llama folder (config.json, safetensors, tokenizer).

    python -m MaxText.to_huggingface configs/base.yml load_parameters_path=CKPT hf_output_path=DIR \
        [hf_output_dtype=bfloat16|float32] [hf_max_shard_mb=5000] [hf_overwrite=true]
    python -m MaxText.to_huggingface configs/base.yml run_name=<run> hf_output_path=DIR

CKPT: a converted `OUT/0/items` (or `OUT`), a run folder, its checkpoints folder or one step's
folder; with `run_name=` the run's newest checkpoint. The model keys come from the checkpoint.
Streams one layer at a time. How: `MaxText/convert/exporter.py`.

DIR must be new or hold no model (`config.json`, `*.safetensors`, an index, `pytorch_model*.bin`,
or a file the export writes); `hf_overwrite=true` replaces the model there (its old shards and
index removed), but the folder the checkpoint was converted from is always refused
(`MaxText/convert/output.py`). Every check runs before anything is written, and the export is
written into `DIR/.exporting/` and moved into place when complete. Exit codes
(`MaxText/exit_codes.py`): 2 with one line for a config, path or checkpoint error (a damaged
checkpoint names the file; a tensor with NaN or infinite values names the tensor), 1 with one
`I/O error:` line when the storage fails (disk full: the partial output is removed).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

log = logging.getLogger("MaxText")


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
    from MaxText.convert import exporter
    from MaxText.convert.output import check_hf_output, recorded_sources, staged_folder

    config = exporter.export_config(argv)
    out = check_hf_output(
        config.hf_output_path,
        overwrite=config.hf_overwrite,
        sources=recorded_sources(config.load_parameters_path),
    )
    plan = exporter.prepare(config)  # before anything is written
    with staged_folder(out, replace=config.hf_overwrite) as staging:
        files = exporter.write(plan, staging)
    log.info(
        "wrote %s: %d tensors in %s (%s) from checkpoint step %d (%s)",
        out,
        len(plan.tensors),
        plan.dtype_name,
        ", ".join(files),
        plan.step,
        plan.item_dir,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
