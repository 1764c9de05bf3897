"""gpt (`decoder_block=gpt`; MaxText's `gpt3`): LayerNorm, a learned position table, biases on
the query, value and output projections (a key bias would add the same q.b to every score of a
query, which softmax ignores), GELU MLP with biases. No Hugging Face format here."""

from __future__ import annotations

from MaxText.model import mlp, norms
from MaxText.model.family import Family

FAMILY = Family(
    name="gpt",
    doc="GPT-3 style (LayerNorm, learned positions, GELU)",
    norm=norms.LayerNorm,
    feed_forward=mlp.BiasGeluMLP,
    fixed_biases=frozenset({"query", "value", "out"}),
    rope=False,
)
