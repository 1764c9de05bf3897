"""Helpers shared by the trainer tests that step a built trainer on their own batches
(tests/test_moe_pipeline.py, tests/test_scanned_pipeline.py) or count its collectives from the
state's layout (tests/test_collectives_trainer.py)."""

from __future__ import annotations

import jax
import numpy as np


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
