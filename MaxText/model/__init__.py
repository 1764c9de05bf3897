"""The decoder-only language model: `decoder.py` (the model, its initialisation and loss),
`layers.py` (norms, RoPE, attention and MLP blocks, one decoder layer), `attention.py` (the
attention kernels `attention=` picks), `moe.py` (the mixture-of-experts feed-forward block)."""

from MaxText.model.decoder import (  # noqa: F401  (the package's public names)
    Decoder,
    canonical_init,
    count_params,
    cross_entropy_sums,
    init_cache,
    init_params,
    moe_stats,
)
