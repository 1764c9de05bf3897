"""No host data in the engine's step loop (#35 item 2): host-to-device copies counted exactly
(`host_transfers.py`).

Per step, the bytes copied from the host are exactly the batch's (each batch leaf on every group
that reads it) for the engine's 2-stage MLP, whose groups have no before-loop work, so their
gradient accumulators are `Fill`s: before, zero-stride numpy views copied to the devices every
step; now made on the devices (`runtime/fills.py`). The trainer's default step and its
checkpoints: tests/test_trainer_memory.py.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from engine_models import make_step, mpmd_mesh, tied_mlp_setup
from host_transfers import batch_bytes, host_to_device_bytes

import jaxpp_integration as jaxpp
from jaxpp_integration.compiler.program import Fill

# ------------------------------------------------------------------ the engine's 2-stage MLP


def test_engine_step_puts_only_the_batch():
    params, batch, loss_fn = tied_mlp_setup(2, 4, tied=False)
    opt = optax.sgd(0.1, momentum=0.9)
    step = make_step(loss_fn, opt, jaxpp.Std1F1B(2))
    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2)).compile(
        params, opt.init(params), batch
    )
    fills = [i for i in compiled.program.instrs if isinstance(i, Fill)]
    assert {f.rank for f in fills} == {0, 1} and len(fills) == 5  # the case this test is about
    state = compiled(params, opt.init(params), batch)[:2]  # the state now lives on its groups
    host_batch = jax.tree.map(np.asarray, batch)
    n_state = len(jax.tree.leaves(state))
    expected = batch_bytes(compiled, range(n_state, n_state + 2), jax.tree.leaves(host_batch))
    assert expected == 2 * np.asarray(batch[0]).nbytes  # inputs on group 0, targets on group 1
    for _ in range(2):
        with host_to_device_bytes() as seen:
            state = compiled(*state, host_batch)[:2]
            jax.block_until_ready(jax.tree.leaves(state))
        assert sum(seen) == expected, seen
    # and nothing at all with the batch already on a device
    on_device = jax.device_put(host_batch, jax.devices()[0])
    with host_to_device_bytes() as seen:
        jax.block_until_ready(compiled(*state, on_device))
    assert seen == []
