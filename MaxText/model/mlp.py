"""Feed-forward blocks: the gated MLP of Llama-style families and gpt's biased GELU MLP.

Shape suffixes: B batch, L length, E embed, M mlp.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.config import Config
from MaxText.model.params import dtype_of, fan_in_init, param

# `mlp_activations` names (MaxText's) -> functions. "gelu" is the tanh approximation (jax's
# default, Hugging Face's `gelu_pytorch_tanh`); "linear" is the identity.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "linear": lambda x: x,
}


def _dense_in(module: nn.Module, name: str, x_BxLxE, config: Config):
    e, m = config.emb_dim, config.mlp_dim
    kernel = param(
        module, name, fan_in_init(), (e, m), ("embed", "mlp"), dtype_of(config.weight_dtype)
    )
    return jnp.einsum("ble,em->blm", x_BxLxE, kernel.astype(x_BxLxE.dtype))


class GatedMLP(nn.Module):
    """(a0(x W0) * a1(x W1)) W2, the two activations a0, a1 of `mlp_activations` (SwiGLU: silu
    and linear; Gemma's GeGLU: gelu and linear). Kernels `wi_0`, `wi_1` [E, M], `wo` [M, E]."""

    config: Config
    input_kernels = 2  # [E, M] kernels before the activation (the planner's FLOPs count)

    @nn.compact
    def __call__(self, x_BxLxE):
        c = self.config
        dtype = dtype_of(c.dtype)
        x = x_BxLxE.astype(dtype)
        first, second = (ACTIVATIONS[a] for a in c.mlp_activations)
        gate_BxLxM = checkpoint_name(_dense_in(self, "wi_0", x, c), "mlpwi")
        up_BxLxM = checkpoint_name(_dense_in(self, "wi_1", x, c), "mlpwi")
        hidden_BxLxM = first(gate_BxLxM) * second(up_BxLxM)
        wo = param(
            self, "wo", fan_in_init(), (c.mlp_dim, c.emb_dim), ("mlp", "embed"),
            dtype_of(c.weight_dtype),
        )  # fmt: skip
        out_BxLxE = jnp.einsum("blm,me->ble", hidden_BxLxM, wo.astype(dtype))
        return checkpoint_name(out_BxLxE, "mlpwo")


class BiasGeluMLP(nn.Module):
    """gpt: gelu(x W_in + b_in) W_out + b_out (tanh-approximated GELU)."""

    config: Config
    input_kernels = 1

    @nn.compact
    def __call__(self, x_BxLxE):
        c = self.config
        dtype, wdtype = dtype_of(c.dtype), dtype_of(c.weight_dtype)
        e, m = c.emb_dim, c.mlp_dim
        x = x_BxLxE.astype(dtype)
        bias_in = param(self, "wi_bias", nn.initializers.zeros, (m,), ("mlp",), wdtype)
        pre_BxLxM = checkpoint_name(_dense_in(self, "wi", x, c) + bias_in.astype(dtype), "mlpwi")
        hidden_BxLxM = jax.nn.gelu(pre_BxLxM, approximate=True)
        wo = param(self, "wo", fan_in_init(), (m, e), ("mlp", "embed"), wdtype)
        out_BxLxE = jnp.einsum("blm,me->ble", hidden_BxLxM, wo.astype(dtype))
        bias_out = param(self, "wo_bias", nn.initializers.zeros, (e,), ("embed",), wdtype)
        return checkpoint_name(out_BxLxE + bias_out.astype(dtype), "mlpwo")
