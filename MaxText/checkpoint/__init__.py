"""Checkpoints: `manager.py` (save, resume by `run_name`, parameters from another run),
`restore.py` (the newest checkpoint every process can read), `layout.py` (training layout <->
the canonical on-disk tree), `integrity.py` (damaged vs unavailable, checksums, early reads),
`pending_save.py` (the save in flight and its failure), `parameters.py` (parameters-only
checkpoints)."""
