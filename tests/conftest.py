"""Test setup: emulate 8 CPU devices before JAX is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def session_compilation_cache(tmp_path_factory):
    """One JAX compilation cache for the whole session, so that the many tests compiling the same
    small model's programs compile each once (for the trainer's subprocesses too, through JAX's
    own JAX_COMPILATION_CACHE_DIR; only process 0 of a multi-process run writes). Executables
    read from the cache are the ones compiled: what a test computes does not change.
    Tests that count compiles or cache events turn it off (`no_compilation_cache`)."""
    import jax

    from jaxpp_integration.jax_compat import reset_compilation_cache

    directory = str(tmp_path_factory.mktemp("jax_cache"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    reset_compilation_cache()
    yield directory
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


@pytest.fixture
def no_compilation_cache(monkeypatch):
    """No persistent compilation cache configured while the test runs (the session's is back
    afterwards)."""
    import jax

    from jaxpp_integration.jax_compat import reset_compilation_cache

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    reset_compilation_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    reset_compilation_cache()


# ---------------------------------------------------------------- time per test file (CI budget)
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Sums setup, call and teardown time per test file (with xdist: on the controller)."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The 15 test files that take longest (their tests' summed time; the CI budget is 20
    minutes for the whole clean-clone run, `.ci/run`)."""
    if not _FILE_SECONDS:
        return
    top = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.write_sep("-", f"time per test file, slowest 15 of {len(_FILE_SECONDS)}")
    for path, seconds in top:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
