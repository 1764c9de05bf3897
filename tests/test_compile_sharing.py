"""One XLA compilation per distinct task program: identical stages on different groups share a
compile, loaded onto each group's own devices.

Compilations are counted with JAX's own backend-compile event (`jax.monitoring`), not with a
counter of the engine, so the tests see every real XLA compile. References are plain `jax.jit`
of the same step (results) and hand counts of the distinct programs of a uniform pipeline."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compare import (
    assert_bitwise,
    assert_close_per_leaf,
    assert_on_group,
    group_devices,
    reordered_sum_rtol,
)
from engine_models import make_step, mpmd_mesh, normal_from
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpp_integration as jaxpp
from jaxpp_integration.compiler.program import Run
from jaxpp_integration.jax_compat import load_compiled_on

# Compiles are counted here: without the session's persistent compilation cache (see conftest),
# except in the test of that cache's own case.
pytestmark = pytest.mark.usefixtures("no_compilation_cache")

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_backend_compiles():
    """Counts XLA compilations (JAX's backend-compile duration event) inside the block."""
    seen = []

    def listener(event, duration, **_):
        if event == BACKEND_COMPILE:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def uniform_mlp(num_stages, n_mb=4, width=8, rows=2, seed=0):
    """`num_stages` identical tanh layers, a marker between stages, MSE loss."""
    normal = normal_from(seed)
    params = [normal(width, width) / np.float32(np.sqrt(width)) for _ in range(num_stages)]
    x, y = normal(n_mb, rows, width), normal(n_mb, rows, width)
    params, x, y = jax.tree.map(jnp.asarray, (params, x, y))

    def loss_fn(p, batch):
        h, target = batch
        for s, w in enumerate(p):
            h = jnp.tanh(h @ w)
            if s < num_stages - 1:
                h = jaxpp.pipeline_enter_stage(h)
        return jnp.mean((h - target) ** 2)

    return params, (x, y), loss_fn


def _compile_counted(step, mesh, args, **kwargs):
    jax.clear_caches()
    with count_backend_compiles() as seen:
        compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mesh, **kwargs).compile(*args)
    return compiled, len(seen)


# Distinct programs of a uniform pipeline with Std1F1B and SGD, whatever the number of stages
# N >= 3: fwd of the first stage (slices the batch), of the middle stages (shared), of the last
# (up to the loss); bwd of the last stage (the loss gradient, then the stage's backward: see
# partition.py), of the middle stages (shared) and of the first (no input cotangent); one
# after-loop SGD update for all ranks. No before-loop program: SGD has no step counter, and the
# gradient accumulators start as fills made on the device (`runtime/fills.py`).
UNIFORM_DISTINCT_PROGRAMS = 7
# Those fills' programs, also compiled once per distinct run of fills: the weight gradient's
# zeros on every group (loaded onto the others), the last group's with the loss sum's zero.
UNIFORM_FILL_PROGRAMS = 2


@pytest.fixture(scope="module")
def uniform_4_cold(tmp_path_factory):
    """The 4-stage uniform step (Std1F1B, SGD) compiled once, cold, into a fresh persistent
    compilation cache (nothing to read there: every program is a real XLA compile, as without a
    cache). Shared by the uniform-stages test's 4-stage case and, as its cold start, by the test
    of compiling again from that cache: (cache folder, step, arguments, compiled, compiles)."""
    from MaxText.cluster.compile_cache import compilation_cache

    cache = tmp_path_factory.mktemp("uniform_4_cache")
    params, batch, loss_fn = uniform_mlp(4)
    opt = optax.sgd(0.1)
    args = (params, opt.init(params), batch)
    step = make_step(loss_fn, opt, jaxpp.Std1F1B(4))
    with compilation_cache(str(cache)):
        compiled, n_compiles = _compile_counted(step, mpmd_mesh(4), args)
    return cache, step, args, compiled, n_compiles


@pytest.mark.parametrize("num_stages", [3, 4])
def test_uniform_stages_compile_once_per_distinct_program(num_stages, request):
    """N uniform stages on N groups: the XLA compile count is the number of distinct programs
    (the same for 3 and 4 groups, not N x), every other group's task is a loaded copy, each
    group's executables live on that group's devices, and the step equals jax.jit bitwise.
    (4 stages: the compile the cache test below starts from, `uniform_4_cold`.)"""
    mesh = mpmd_mesh(num_stages)
    if num_stages == 4:
        _, step, (params, opt_state, batch), compiled, n_compiles = request.getfixturevalue(
            "uniform_4_cold"
        )
    else:
        params, batch, loss_fn = uniform_mlp(num_stages)
        opt = optax.sgd(0.1)
        opt_state = opt.init(params)
        step = make_step(loss_fn, opt, jaxpp.Std1F1B(num_stages))
        compiled, n_compiles = _compile_counted(step, mesh, (params, opt_state, batch))

    codes = {id(i.code): i.code for i in compiled.program.instrs if isinstance(i, Run)}
    assert n_compiles == UNIFORM_DISTINCT_PROGRAMS + UNIFORM_FILL_PROGRAMS, [
        c.name for c in codes.values()
    ]
    assert compiled.compile_stats.compiles == UNIFORM_DISTINCT_PROGRAMS
    assert compiled.compile_stats.loads == len(codes) - UNIFORM_DISTINCT_PROGRAMS

    for idx, ins in enumerate(compiled.program.instrs):
        if isinstance(ins, Run):
            exe = compiled.executables[idx]
            want = group_devices(mesh, ins.code.rank)
            for sh in (*exe.input_shardings[0], *exe.output_shardings):
                assert set(sh.device_set) == want, (ins.name, sh)

    ref = jax.jit(step)(params, opt_state, batch)
    got = compiled(params, opt_state, batch)
    assert_bitwise(ref, got)
    for s in range(num_stages):
        assert_on_group(got[0][s], mesh, (s,))
        assert_on_group(got[3][s], mesh, (s,))


def test_loaded_copies_run_collectives_on_their_group():
    """4 groups x 2 devices, weights sharded P("fsdp") inside each group: the optimizer update
    (one program, compiled for group 0 and loaded onto groups 1-3) runs its cross-device work on
    each group's own pair of devices. Reference: jax.jit with the same sharding on a 2-device
    fsdp mesh; the loss is bitwise, and the parameters within `reordered_sum_rtol` of the step's
    4 x 2 rows (tests/compare.py) of each leaf's scale, as in
    test_engine_features.test_fsdp_inside_stages_equals_jit (the sharded update fuses
    differently in the after-loop program; Adam's first update g / (|g| + eps) keeps the
    gradients' signs, its rounding differences stay within the sums')."""
    params, batch, loss_fn = uniform_mlp(4)
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    step = make_step(loss_fn, opt, jaxpp.Std1F1B(4))
    spec = lambda leaf: P("fsdp") if leaf.ndim >= 1 else P()  # noqa: E731
    specs = (jax.tree.map(spec, params), jax.tree.map(spec, opt_state), P())
    mesh = mpmd_mesh(4, inner=2)
    compiled, n_compiles = _compile_counted(step, mesh, (params, opt_state, batch), in_specs=specs)
    assert (
        n_compiles - UNIFORM_FILL_PROGRAMS
        == compiled.compile_stats.compiles
        < len({id(i.code) for i in compiled.program.instrs if isinstance(i, Run)})
    )
    ref_mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    put = lambda tree, sp: jax.tree.map(  # noqa: E731
        lambda x, s: jax.device_put(x, NamedSharding(ref_mesh, s)), tree, sp
    )
    ref = jax.jit(step)(put(params, specs[0]), put(opt_state, specs[1]), batch)
    got = compiled(params, opt_state, batch)
    assert_bitwise(ref[2], got[2])
    assert_close_per_leaf(ref[0], got[0], rtol=reordered_sum_rtol(4 * 2), what="params ")
    for s in range(4):
        assert_on_group(got[0][s], mesh, (s,))
        assert got[0][s].first_array.sharding.spec == P("fsdp")


def test_load_compiled_on_other_devices_runs_there_without_compiling():
    """`jax_compat.load_compiled_on`: a sharded program with a cross-device reduction and a
    donated input, compiled for devices 0-1 and loaded onto 2-3 without an XLA compile, gives
    the original executable's results bitwise, on devices 2-3, and consumes its donated input."""
    devs = jax.devices()
    m0 = jax.sharding.Mesh(np.array(devs[0:2]).reshape(1, 2), ("stage", "fsdp"))
    m1 = jax.sharding.Mesh(np.array(devs[2:4]).reshape(1, 2), ("stage", "fsdp"))
    specs = (P("fsdp"), P(None, "fsdp"), P())

    def f(x, w, acc):
        return jnp.tanh(x @ w).sum(0), acc + x.sum()

    avals = [
        jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(m0, s))
        for shape, s in zip([(8, 16), (16, 16), ()], specs)
    ]
    c0 = jax.jit(f, donate_argnums=(2,)).lower(*avals).compile()
    with count_backend_compiles() as seen:
        c1 = load_compiled_on(c0, list(m0.devices.flat), list(m1.devices.flat))
    assert c1 is not None and not seen
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((8, 16)), rng.standard_normal((16, 16)), np.float32(1.0)]
    host = [np.asarray(h, np.float32) for h in host]
    on = lambda m: [jax.device_put(h, NamedSharding(m, s)) for h, s in zip(host, specs)]  # noqa: E731
    a0, a1 = on(m0), on(m1)
    out0, out1 = c0(*a0), c1(*a1)
    assert_bitwise(out0, out1)
    for o in out1:
        assert set(o.sharding.device_set) == set(devs[2:4])
    assert a1[2].is_deleted()


def test_compile_threads_gives_the_same_program():
    """compile_threads=2 compiles independent programs concurrently: the same number of XLA
    compiles and the same results as jax.jit, bitwise."""
    params, batch, loss_fn = uniform_mlp(4)
    opt = optax.sgd(0.1)
    opt_state = opt.init(params)
    step = make_step(loss_fn, opt, jaxpp.Std1F1B(4))
    compiled, n_compiles = _compile_counted(
        step, mpmd_mesh(4), (params, opt_state, batch), compile_threads=2
    )
    assert n_compiles == UNIFORM_DISTINCT_PROGRAMS + UNIFORM_FILL_PROGRAMS
    assert_bitwise(jax.jit(step)(params, opt_state, batch), compiled(params, opt_state, batch))


def test_loaded_copies_of_cached_programs_run(uniform_4_cold):
    """With JAX's persistent compilation cache warm (`jax_cache_dir`), compiling the same step
    again (a restart) compiles nothing: every distinct program is read from the cache, and the
    other groups' copies are loaded from the executable bytes read there (XLA:CPU cannot
    serialize a deserialized executable again: such a copy fails with "Function ... not found"
    when it runs). Real compiles = JAX's backend-compile events minus its cache hits; the warm
    step runs bitwise like jax.jit. The cold compile that filled the cache: `uniform_4_cold`."""
    from MaxText.cluster.compile_cache import compilation_cache

    cache, step, (params, opt_state, batch), cold, n_cold = uniform_4_cold
    hits = []

    def listener(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    with compilation_cache(str(cache)):
        jax.monitoring.register_event_listener(listener)
        try:
            warm, n_warm = _compile_counted(step, mpmd_mesh(4), (params, opt_state, batch))
        finally:
            jax.monitoring.unregister_event_listener(listener)
        ref = jax.jit(step)(params, opt_state, batch)
        assert_bitwise(ref, warm(params, opt_state, batch))
    assert n_cold - UNIFORM_FILL_PROGRAMS == UNIFORM_DISTINCT_PROGRAMS
    assert cold.compile_stats.compiles == UNIFORM_DISTINCT_PROGRAMS
    assert n_warm - len(hits) == 0 == warm.compile_stats.compiles
    assert len(hits) - UNIFORM_FILL_PROGRAMS == UNIFORM_DISTINCT_PROGRAMS
    assert warm.compile_stats.persistent_hits == UNIFORM_DISTINCT_PROGRAMS
    assert warm.compile_stats.loads == cold.compile_stats.loads == 5


def test_a_relocation_that_fails_is_compiled_instead(monkeypatch, caplog):
    """Loading a program compiled for one group onto another raising anything (here the
    backend's deserializer, handed bytes that are no executable, as a PJRT plugin may reject
    one it cannot move) costs a compile, not the step: each group whose load fails compiles its
    own program, one log line says so per load, and the step is still jax.jit's, bitwise."""
    from jaxpp_integration.compiler import compile as compile_mod

    params, batch, loss_fn = uniform_mlp(3)
    opt = optax.sgd(0.1)
    opt_state = opt.init(params)
    step = make_step(loss_fn, opt, jaxpp.Std1F1B(3))
    monkeypatch.setattr(
        compile_mod._Compiler, "movable_source", lambda self, key, exe: (exe, b"not an executable")
    )
    with caplog.at_level("WARNING", logger="jaxpp_integration"):
        compiled, _ = _compile_counted(step, mpmd_mesh(3), (params, opt_state, batch))
    codes = {id(i.code) for i in compiled.program.instrs if isinstance(i, Run)}
    stats = compiled.compile_stats
    assert stats.loads == 0 and stats.compiles == len(codes)  # every group compiled its own
    failed = [r.getMessage() for r in caplog.records if "could not load" in r.getMessage()]
    assert len(failed) == len(codes) - UNIFORM_DISTINCT_PROGRAMS  # each attempted load, once
    assert all(m.endswith("; compiling it there instead") for m in failed), failed
    assert "(group 0's compile) onto devices [1]" in failed[0]
    assert_bitwise(jax.jit(step)(params, opt_state, batch), compiled(params, opt_state, batch))
