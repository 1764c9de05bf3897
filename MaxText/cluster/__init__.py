"""The machine a run uses: `devices.py` (multi-process bootstrap, CPU device emulation),
`compile_cache.py` (JAX's persistent compilation cache)."""
