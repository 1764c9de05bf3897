.PHONY: setup test test-fast lint format bench
setup:
	./setup.sh
test:
	.venv/bin/python -m pytest -q tests
test-fast:
	.venv/bin/python -m pytest -q -m "not slow" tests
lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check .
format:
	.venv/bin/ruff format . && .venv/bin/ruff check --fix .
bench:
	.venv/bin/python benchmarks/engine_overhead.py
