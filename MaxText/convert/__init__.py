"""Hugging Face checkpoints in and out, for every family with a format: `safetensors_io.py` (the
file format, one tensor at a time), `layout.py` (a family's tensor table expanded for one config:
names, shapes, layout changes), `hf_config.py` (config.json <-> model keys), `importer.py`
(`python -m MaxText.to_maxtext`), `exporter.py` (`python -m MaxText.to_huggingface`). The tables
themselves are data in each family's file (`MaxText/model/<family>.py`)."""
