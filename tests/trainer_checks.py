"""Helpers shared by the trainer tests that step a built trainer on their own batches
(tests/test_moe_pipeline.py, tests/test_scanned_pipeline.py), build each layout's trainer once
(`built_once`: tests/test_train.py, tests/test_scanned_pipeline.py), move a state between two
trainers' layouts (tests/test_train.py, tests/test_moe_pipeline.py) or count its collectives from
the state's layout (tests/test_collectives_trainer.py)."""

from __future__ import annotations

import jax
import numpy as np

from MaxText.checkpoint.layout import CanonicalLayout, numpy_stack


def random_batches(config, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`n` batches of `config`'s global batch: random tokens (targets the inputs shifted by one)
    and a random mask holding ~80 % of the targets."""
    rng = np.random.default_rng(seed)
    b, length = config.global_batch_size, config.max_target_length
    out = []
    for _ in range(n):
        x = rng.integers(0, config.vocab_size, (b, length + 1)).astype(np.int32)
        mask = (rng.random((b, length)) > 0.2).astype(np.float32)
        out.append({"inputs": x[:, :-1], "targets": x[:, 1:], "targets_mask": mask})
    return out


def fsdp_scatters_per_microbatch(state) -> int:
    """Reduce-scatters over fsdp one microbatch's backward makes (read off the state): one per
    layer of every fsdp-sharded weight stacked for a stage's layer scan (`layers_stage_<s>`,
    leading axis = layer; a mixture of experts' expert weights among them), one per other
    fsdp-sharded weight."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state["params"])[0]:
        spec = [a for e in leaf.sharding.spec for a in (e if isinstance(e, tuple) else (e,))]
        if "fsdp" in spec:
            total += leaf.shape[0] if str(path[0].key).startswith("layers_stage_") else 1
    return total


def relayout(state, source, target):
    """`state` (numpy, in trainer `source`'s layout) in trainer `target`'s layout, through the
    checkpoints' canonical tree (every layer its own sub-tree): exact, the same values."""
    shapes = [jax.tree.map(lambda a: a.shape, t.abstract_state) for t in (source, target)]
    if shapes[0] == shapes[1]:  # the same tree and shapes: the same layout
        return state
    flat = jax.tree.leaves(
        CanonicalLayout(source.abstract_state).to_canonical(jax.tree.leaves(state))
    )
    layout = CanonicalLayout(target.abstract_state)
    back = layout.from_canonical(flat, range(len(flat)), numpy_stack)
    return jax.tree.unflatten(layout.treedef, [back[j] for j in range(len(back))])


def built_once(build, root):
    """`get(*overrides)`: `build(root, *overrides)` made once per distinct `overrides` (a module
    fixture's trainers, shared by the file's tests)."""
    built: dict = {}

    def get(*overrides):
        if overrides not in built:
            built[overrides] = build(root, *overrides)
        return built[overrides]

    return get
