"""The engine on GPUs: every built-in schedule against `jax.jit` of the same step (for
tests/test_gpu_suite.py; run on a GPU node, with the environment that test sets).

Usage: python gpu_engine_worker.py GROUPS
Prints one `RESULT <json>` line per schedule: the largest difference of any output leaf relative
to that leaf's largest magnitude, whether every leaf was bitwise equal, and whether every
group's arrays are on that group's GPUs. Float32 with `jax_default_matmul_precision=highest`;
the test runs it with deterministic ops and autotuning off (XLA_FLAGS).
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
from engine_models import clipping_sgd, make_step, mpmd_mesh, tied_mlp_setup  # noqa: E402

import jaxpp_integration as jaxpp  # noqa: E402

groups = int(sys.argv[1])
MICROBATCHES = 2 * 2 * groups  # DualPipeV needs at least its 2 x groups stages
SCHEDULES = {
    "gpipe": lambda: jaxpp.GPipe(groups),
    "1f1b": lambda: jaxpp.Std1F1B(groups),
    "eager_1f1b": lambda: jaxpp.Eager1F1B(groups),
    "interleaved_1f1b": lambda: jaxpp.Interleaved1F1B(2 * groups, groups),
    "zero_bubble": lambda: jaxpp.ZeroBubble(groups),
    "dualpipev": lambda: jaxpp.DualPipeV(groups),
}

assert jax.devices()[0].platform == "gpu", jax.devices()
for name, make in SCHEDULES.items():
    schedule = make()
    params, batch, loss_fn = tied_mlp_setup(schedule.num_stages, MICROBATCHES)
    opt = clipping_sgd()
    step = make_step(loss_fn, opt, schedule)
    opt_state = opt.init(params)
    with jax.default_device(jax.devices()[0]):
        ref = jax.jit(step)(params, opt_state, batch)
    mesh = mpmd_mesh(groups)
    got = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(params, opt_state, batch)(
        params, opt_state, batch
    )
    worst, bitwise, placed = 0.0, True, True
    for want, leaf in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        want = np.asarray(want)
        scale = float(np.abs(want).max()) or 1.0
        for group, array in leaf.arrays.items():
            value = np.asarray(array)
            worst = max(worst, float(np.abs(value - want).max()) / scale)
            bitwise &= value.tobytes() == want.tobytes()
            placed &= array.sharding.device_set == set(mesh.devices_of(group))
    print("RESULT " + json.dumps({"schedule": name, "max_rel": worst, "bitwise": bitwise,
                                  "placed": placed}), flush=True)  # fmt: skip
