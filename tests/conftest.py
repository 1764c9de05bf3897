"""Test setup: emulate 8 CPU devices before JAX is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402
from maxtext_logs import logs  # noqa: E402, F401 (a fixture for every test file)


@pytest.fixture(scope="session", autouse=True)
def session_compilation_cache(tmp_path_factory):
    """One JAX compilation cache for the whole session, so that the many tests compiling the same
    small model's programs compile each once (for the trainer's subprocesses too, through JAX's
    own JAX_COMPILATION_CACHE_DIR; only process 0 of a multi-process run writes), and for every
    xdist worker alike (the workers' temporary folders share a parent; entries are written whole,
    `atomic_persistent_cache_writes`, so a worker never reads one being written). Executables
    read from the cache are the ones compiled: what a test computes does not change.
    Tests that count compiles or cache events turn it off (`no_compilation_cache`)."""
    import jax

    from jaxpp_integration.jax_compat import (
        atomic_persistent_cache_writes,
        reset_compilation_cache,
    )

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    directory = str(root / "jax_cache")
    os.makedirs(directory, exist_ok=True)
    atomic_persistent_cache_writes()
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
# Wall time alone misleads on a shared machine (other jobs stretch it), so each test phase also
# records the CPU seconds it cost: this process's (all its threads, XLA's compile threads
# included) plus those of the child processes it waited for (the trainer's subprocesses). With
# xdist the figures travel to the controller in the report's user_properties.
_CPU_MARK = pytest.StashKey[float]()
_FILE_TIMES: dict[str, list[float]] = {}  # path -> [wall s, cpu s, tests]
_TEST_TIMES: dict[str, list[float]] = {}  # node id -> [wall s, cpu s]


def _cpu_seconds() -> float:
    import resource

    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_MARK] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the CPU seconds spent since the previous phase ended (module
    fixtures are paid in the setup of a file's first test, as their wall time is)."""
    outcome = yield
    now = _cpu_seconds()
    report = outcome.get_result()
    report.user_properties.append(("cpu_s", now - item.stash.get(_CPU_MARK, now)))
    item.stash[_CPU_MARK] = now


def pytest_runtest_logreport(report):
    """Sums wall and CPU time of setup, call and teardown per test file (with xdist: on the
    controller)."""
    cpu = dict(report.user_properties).get("cpu_s", 0.0)
    row = _FILE_TIMES.setdefault(report.nodeid.split("::", 1)[0], [0.0, 0.0, 0])
    row[0] += report.duration
    row[1] += cpu
    row[2] += report.when == "call"
    test = _TEST_TIMES.setdefault(report.nodeid, [0.0, 0.0])
    test[0] += report.duration
    test[1] += cpu


def pytest_terminal_summary(terminalreporter):
    """Every test file's summed wall and CPU time, slowest first (the CI budget is 20 minutes for
    the whole clean-clone run, `.ci/run`); with PYTEST_FILE_TIMES=<path>, also as JSON there
    ({"files": {path: {wall_s, cpu_s, tests}}, "tests": {node id: {wall_s, cpu_s}}})."""
    if not _FILE_TIMES:
        return
    rows = sorted(_FILE_TIMES.items(), key=lambda kv: -kv[1][0])
    wall, cpu = sum(r[0] for _, r in rows), sum(r[1] for _, r in rows)
    terminalreporter.write_sep("-", f"time per test file ({len(rows)} files, slowest first)")
    terminalreporter.write_line(f"{'wall s':>8}  {'CPU s':>8}  {'tests':>5}  file")
    for path, (w, c, n) in rows:
        terminalreporter.write_line(f"{w:8.1f}  {c:8.1f}  {n:5d}  {path}")
    terminalreporter.write_line(f"{wall:8.1f}  {cpu:8.1f}  {'':5}  all files (summed)")
    target = os.environ.get("PYTEST_FILE_TIMES")
    if target:
        import json

        table = {
            "files": {p: {"wall_s": w, "cpu_s": c, "tests": n} for p, (w, c, n) in rows},
            "tests": {k: {"wall_s": w, "cpu_s": c} for k, (w, c) in _TEST_TIMES.items()},
        }
        with open(target, "w") as f:
            json.dump(table, f, indent=1)
