"""A fine-tune's starting state (`load_parameters_path`): the optimizer's initial state made from
the parameters' shapes (`MaxText.checkpoint.manager.initial_state_leaves`), for every `opt_type`.

The reference is optax's own `optimizer.init` of random parameters (as a fresh state's optimizer
state is made, `MaxText.train_step.make_init_fn`): the leaves must be equal bit for bit, so no
optimizer's initial state may depend on the parameters' values. Where the pipelined state's
leaves are made is checked in tests/test_checkpointing.py (a fine-tune at pipeline_parallelism=4).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from small_model import SMALL_MODEL_SHAPE, merged

from MaxText.checkpoint.manager import initial_state_leaves
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.model import Decoder
from MaxText.optimizer import make_optimizer
from MaxText.train_step import state_specs


@pytest.mark.parametrize("opt_type", ["adamw", "adam", "sgd", "adafactor"])
def test_initial_optimizer_state_is_optax_init_of_any_parameters(opt_type):
    config = load_config(
        merged(str(CONFIGS_DIR / "base.yml"), *SMALL_MODEL_SHAPE, f"opt_type={opt_type}")
    )
    optimizer, _ = make_optimizer(config)
    abstract, _ = state_specs(config, Decoder(config), optimizer)
    leaves = jax.tree.leaves(abstract["params"])
    keys = jax.random.split(jax.random.key(7), len(leaves))
    params = jax.tree.unflatten(
        jax.tree.structure(abstract["params"]),
        [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves, strict=True)],
    )
    assert all(np.asarray(x).any() for x in jax.tree.leaves(params))
    want = jax.tree.leaves({"step": np.int32(0), "opt_state": jax.jit(optimizer.init)(params)})
    got_all = jax.jit(initial_state_leaves(abstract, optimizer))()
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    got = [x for x, (path, _) in zip(got_all, flat, strict=True) if path[0].key != "params"]
    assert len(got) == len(want) > 1
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        w = np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (opt_type, i)
        np.testing.assert_array_equal(
            np.atleast_1d(np.asarray(g)).view(np.uint8),
            np.atleast_1d(w).view(np.uint8),
            err_msg=f"{opt_type} leaf {i}",
        )


def test_each_group_makes_only_its_share_at_70b_width(tmp_path):
    """Llama 2 70B's width (2 of its layers, pp=2 x fsdp=4), compiled on abstract inputs and never
    run: each group's program making the fine-tune's optimizer state outputs exactly that group's
    share of it per device (Adam's two moments of the parameters the group's tasks read, and the
    counters) with no temporaries, where `init_state` makes the whole state on group 0."""
    from jax.sharding import NamedSharding

    from MaxText import sharding
    from MaxText.checkpoint.layout import placement_for
    from MaxText.cluster import devices
    from MaxText.train_step import build_trainer

    keys = ["model_name=llama2-70b", "num_decoder_layers=2", "pipeline_parallelism=2",
            "ici_fsdp_parallelism=4", "global_batch_size=16", "max_target_length=64",
            "enable_checkpointing=false", f"base_output_directory={tmp_path}"]  # fmt: skip
    config = load_config([str(CONFIGS_DIR / "base.yml"), *keys])
    trainer = build_trainer(
        config, sharding.make_mesh(config, devices.setup(**config.device_args()))
    )
    abstract = jax.tree.leaves(trainer.abstract_state)
    placement = placement_for(trainer, abstract)
    flat = jax.tree_util.tree_flatten_with_path(trainer.abstract_state)[0]
    others = [j for j, (path, _) in enumerate(flat) if path[0].key != "params"]

    def per_device(j, r):
        s = NamedSharding(trainer.mpmd_mesh.unstack[r], placement.specs[j])
        return int(np.prod(s.shard_shape(abstract[j].shape))) * abstract[j].dtype.itemsize

    values = initial_state_leaves(trainer.abstract_state, trainer.optimizer)
    programs = placement.programs(values, others)
    assert sorted(programs) == [0, 1]
    whole = sum(a.size * a.dtype.itemsize for a in abstract) / 4  # the whole state on 4 devices
    for r, (held, program) in programs.items():
        m = program.lower().compile().memory_analysis()
        share = sum(per_device(j, r) for j in held)
        # XLA:CPU counts the output tuple's table too: one 8-byte pointer per output
        assert m.output_size_in_bytes == share + 8 * len(held), r
        assert m.temp_size_in_bytes == 0, r
        # Adam's moments are 2/3 of the state, and each group's about half of them (one layer
        # and the embedding, or one layer and the head): a third, never the whole 2/3
        assert 0.3 * whole < share < 0.5 * whole, (r, share, whole)
