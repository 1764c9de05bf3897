.PHONY: setup test test-fast lint format bench
setup:
	./setup.sh
test:
	.venv/bin/python -m pytest -q -n 2 --dist loadfile tests
test-fast:
	.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not slow" tests
lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check .
format:
	.venv/bin/ruff format . && .venv/bin/ruff check --fix .
bench:
	.venv/bin/python benchmarks/engine_overhead.py
