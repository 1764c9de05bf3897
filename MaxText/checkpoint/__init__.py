"""Checkpoints: `manager.py` (save, resume by `run_name`, parameters from another run),
`layout.py` (training layout <-> the canonical on-disk tree), `integrity.py` (what marks a
checkpoint damaged, and the early reads that find it)."""
