"""The decoder-only language model, one file per family.

- `decoder.py`: the model (embedding, layers, final norm, head), its initialisation and loss;
- `layers.py`: one decoder layer (the residual block) and its remat wrapping;
- blocks: `self_attention.py` (projections, RoPE, KV cache), `attention.py` (the kernels
  `attention=` picks), `mlp.py` (feed-forward blocks), `norms.py`, `rope.py`, `params.py`
  (dtypes, initialisers, logical axes);
- families: `family.py` (what a family declares: model choices and its Hugging Face tables),
  `registry.py` (`decoder_block` -> family), and one file each: `llama.py`, `mistral.py`,
  `qwen2.py`, `qwen3.py`, `gemma2.py`, `gpt.py`.
"""

from MaxText.model.decoder import (  # noqa: F401  (the package's public names)
    Decoder,
    canonical_init,
    canonical_init_config,
    count_params,
    cross_entropy_sums,
    init_cache,
    init_params,
)
from MaxText.model.family import COMMON_FIELDS, Family, HfFormat, TensorRow  # noqa: F401
from MaxText.model.registry import (  # noqa: F401
    FAMILIES,
    family_for_architecture,
    family_of,
    hf_architectures,
)
