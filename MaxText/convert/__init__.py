"""Hugging Face Llama checkpoints in and out: `safetensors_io.py` (the file format, one tensor at a
time), `layout.py` (tensor names and layouts), `hf_config.py` (config.json <-> model keys),
`importer.py` (`python -m MaxText.to_maxtext`), `exporter.py`
(`python -m MaxText.to_huggingface`)."""
