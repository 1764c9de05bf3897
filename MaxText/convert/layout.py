"""A family's tensor table, expanded for one config: every tensor's Hugging Face name and shape,
our path and shape, and the two layout maps.

Our canonical parameter tree is the one checkpoints store (`MaxText/checkpoint/layout.py`): every
decoder layer its own `layers_<i>` sub-tree, kernels `[in, ...out]` with heads split out
(`query_kernel [E, H, D]`, `out_kernel [H, D, E]`). Hugging Face stores PyTorch `Linear.weight`s,
`[out, in]`. A family's table (`HfFormat.tensors`, in `MaxText/model/<family>.py`) names, per
parameter, the layout change between the two; the changes are:

    same        any shape        identical (embeddings, norm scales)
    transpose   ours [A, B]      hf [B, A]          (MLP kernels, the output head)
    heads_in    ours [E, N, D]   hf [N*D, E]        (q, k, v projections)
    heads_out   ours [N, D, E]   hf [E, N*D]        (the output projection)
    heads_bias  ours [N, D]      hf [N*D]           (q, k, v biases)

Both sides rotate the two halves of each head's dimensions in RoPE (Hugging Face's
`rotate_half`), so q and k need no permutation: a head's rows keep their order. Every map is a
transpose and reshape, exact in any dtype; dtype conversion is the caller's.

Our shapes come from the model itself (`jax.eval_shape` of its canonical initialisation), so a
table can only name parameters the model has: `tensors_for` drops the rows whose parameter the
config does not create (a tied head) and fails on a parameter no row names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from MaxText.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Tensor:
    path: tuple[str, ...]  # in our canonical params tree
    hf_name: str
    shape: tuple[int, ...]  # ours
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _same(shape):
    return shape, (lambda w: w), (lambda x: x)


def _transpose(shape):
    a, b = shape
    return (b, a), (lambda w: w.T), (lambda x: x.T)


def _heads_in(shape):
    # [N*D, E] <-> [E, N, D]: row (head, j) of the PyTorch weight is column (head, j)
    e, n, d = shape
    return (n * d, e), (lambda w: w.T.reshape(e, n, d)), (lambda x: x.reshape(e, n * d).T)


def _heads_out(shape):
    n, d, e = shape
    return (e, n * d), (lambda w: w.T.reshape(n, d, e)), (lambda x: x.reshape(n * d, e).T)


def _heads_bias(shape):
    n, d = shape
    return (n * d,), (lambda w: w.reshape(n, d)), (lambda x: x.reshape(n * d))


# name -> (our shape -> (hf shape, hf -> ours, ours -> hf))
LAYOUTS = {
    "same": _same,
    "transpose": _transpose,
    "heads_in": _heads_in,
    "heads_out": _heads_out,
    "heads_bias": _heads_bias,
}


def canonical_shapes(config) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Path -> shape of every parameter of `config`'s model in the canonical on-disk tree
    (`layers_<i>` per layer), from an abstract initialisation (nothing is computed)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from MaxText.model import Decoder, canonical_init_config

    one_scan = dataclasses.replace(canonical_init_config(config), attention="dot_product")
    tokens = jnp.zeros((1, 1), jnp.int32)
    boxed = jax.eval_shape(Decoder(one_scan).init, jax.random.key(0), tokens)["params"]
    shapes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nn.unbox(boxed))[0]:
        names = tuple(p.key for p in path)
        if names[0] == "layers":
            for i in range(config.num_decoder_layers):
                shapes[(f"layers_{i}", *names[1:])] = tuple(leaf.shape[1:])
        else:
            shapes[names] = tuple(leaf.shape)
    return shapes


def _expand(rows, num_layers: int):
    """(our path, hf name, layout) per tensor: rows without `{i}` where they stand, each run of
    `{i}` rows repeated for every layer (Hugging Face's order: embedding, layers, norm, head)."""
    out, run = [], []

    def flush():
        for i in range(num_layers):
            out.extend((r.ours.format(i=i), r.hf.format(i=i), r.layout) for r in run)
        run.clear()

    for row in rows:
        if "{i}" in row.ours:
            run.append(row)
            continue
        flush()
        out.append((row.ours, row.hf, row.layout))
    flush()
    return out


def tensors_for(config) -> list[Tensor]:
    """Every tensor of `config`'s model in its family's Hugging Face format, in file order."""
    from MaxText.model import family_of

    family = family_of(config)
    if family.hf is None:
        raise ConfigError(
            f"decoder_block={config.decoder_block} has no Hugging Face format here (formats: "
            f"the families of MaxText/model/registry.py with an `hf` table)"
        )
    shapes = canonical_shapes(config)
    tensors = []
    for ours, hf_name, layout in _expand(family.hf.tensors, config.num_decoder_layers):
        path = tuple(ours.split("/"))
        if path not in shapes:
            continue  # a parameter this config does not create (a tied head, an unused bias)
        shape = shapes.pop(path)
        hf_shape, to_ours, to_hf = LAYOUTS[layout](shape)
        assert math.prod(hf_shape) == math.prod(shape), (hf_name, shape, hf_shape)
        tensors.append(Tensor(path, hf_name, shape, hf_shape, to_ours, to_hf))
    if shapes:
        missing = ", ".join("/".join(p) for p in sorted(shapes)[:3])
        raise AssertionError(f"the {family.name} tensor table has no row for {missing}")
    return tensors
