"""What a model family is: a `Family` value (its model-side choices) and an `HfFormat` value (its
Hugging Face checkpoint format as tables). Each family's file (`llama.py`, `gpt.py`, ...) declares
one `FAMILY`; `registry.py` picks it by `decoder_block`.

Model side. Every family runs the same decoder (`decoder.py`) and decoder layer (`layers.py`):
pre-norm residual blocks of self-attention and a feed-forward block. A family chooses, as data:
its norm (`norm`, with Gemma's `(1 + w)` as `norm_scale_offset=1`), the feed-forward block (a flax
module class taking `(config, name=...)`: the gated MLP, gpt's, an MoE block), the projections
with a fixed bias, RoPE or a learned position table. Where layers differ, the differences are data
too (per-layer values fed to one layer program, see `decoder.py`).

Checkpoint side (`HfFormat`, run by `MaxText/convert/`): the `architectures` / `model_type` it
reads and writes, `tensors` (one `TensorRow` per parameter: its path in our canonical tree, its
Hugging Face name, and the layout change between the two, by name: see
`MaxText/convert/layout.py`), `fields` (model keys copied to and from config.json fields),
`fixed` (model keys the format implies: set on import, required on export), `accepted`
(config.json fields that must hold one of the listed values, with the reason otherwise),
`template` (constant fields of a freshly written config.json), `defaults` (what an absent field
means to the family's modeling class), and two small functions for the
fields that are not one-to-one (`read`: config.json -> keys, `write`: config -> config.json
fields).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from MaxText.model import mlp, norms

# Our model key -> the config.json field it is copied from and to (every family has these).
COMMON_FIELDS = {
    "emb_dim": "hidden_size",
    "mlp_dim": "intermediate_size",
    "num_decoder_layers": "num_hidden_layers",
    "num_query_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
}


@dataclasses.dataclass(frozen=True)
class TensorRow:
    """One parameter: `ours` is its '/'-separated path in our canonical tree and `hf` its Hugging
    Face name, `{i}` standing for the layer index in both; `layout` names the change between the
    two arrays (`MaxText/convert/layout.py`: same, transpose, heads_in, heads_out, heads_bias).
    A row whose path the model does not have (a tied head, a bias the config turns off) is
    skipped; every parameter the model has must have a row."""

    ours: str
    hf: str
    layout: str


@dataclasses.dataclass(frozen=True)
class HfFormat:
    architecture: str  # config.json `architectures` [0]
    model_type: str
    tensors: tuple[TensorRow, ...]
    fields: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(COMMON_FIELDS))
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # config.json field -> (the values this format converts, why others are refused); an absent
    # field reads as None.
    accepted: Mapping[str, tuple[tuple[Any, ...], str]] = dataclasses.field(default_factory=dict)
    template: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # config.json field -> the value its modeling class assumes when the file leaves it out
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # (config.json dict, where) -> further model keys; may raise ConfigError
    read: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    # config -> further config.json fields (the ones `read` takes)
    write: Callable[[Any], dict[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # the decoder_block value
    norm: type = norms.RMSNorm  # RMSNorm or LayerNorm: every norm of the model
    norm_scale_offset: float = 0.0  # RMSNorm multiplies by (offset + w): Gemma's 1
    feed_forward: type = mlp.GatedMLP  # flax module class, called as (config, name="mlp")
    fixed_biases: frozenset[str] = frozenset()  # projections with a bias whatever the keys
    rope: bool = True  # RoPE on q and k; False: a learned position table (gpt)
    scale_embedding: bool = False  # embeddings x sqrt(emb_dim), in the activation dtype (Gemma)
    # Which layers attend locally (within sliding_window_size), repeating: layer i is local iff
    # window_pattern[i % len(window_pattern)]. (True,): every layer (Mistral); Gemma 2: (True,
    # False), the even layers.
    window_pattern: tuple[bool, ...] = (True,)
    hf: HfFormat | None = None  # None: no Hugging Face format (to_huggingface refuses)
    doc: str = ""  # one line for messages and docs

    def layer_windows(self, config) -> tuple[int, ...]:
        """The attention window of every layer (0: global), the per-layer data `decoder.py`
        feeds to the layers."""
        w, pattern = config.sliding_window_size, self.window_pattern
        layers = range(config.num_decoder_layers)
        return tuple(w if pattern[i % len(pattern)] else 0 for i in layers)


# The model keys at the values that switch a feature off: a format that does not read a key from
# config.json fixes it at this value (a Llama checkpoint has no q/k norm, no soft cap, ...).
PLAIN_KEYS = {
    "use_qk_norm": False,
    "attention_bias": False,
    "mlp_activations": ("silu", "linear"),
    "sliding_window_size": 0,
    "attn_logits_soft_cap": 0.0,
    "final_logits_soft_cap": 0.0,
    "query_pre_attn_scalar": 0.0,
    "use_post_attn_norm": False,
    "use_post_ffw_norm": False,
}


def plain_except(*read: str, **fixed: Any) -> dict[str, Any]:
    """`PLAIN_KEYS` without the keys a format reads from config.json, with `fixed` over it."""
    return {**{k: v for k, v in PLAIN_KEYS.items() if k not in read}, **fixed}
