"""Measurements of the engine and the trainer; each module is a script (`python benchmarks/X.py`)
that writes its JSON under `benchmarks/results/` (see benchmarks/README.md)."""
