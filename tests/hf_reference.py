"""The independent Llama reference of the checkpoint tests (nothing here imports MaxText).

- `random_tensors(cfg, seed)`: PyTorch-named, `[out, in]` weights of a random Llama, scaled so the
  logits are O(1) (Hugging Face's own init, std 0.02, gives logits ~1e-2, where a 1e-5 tolerance
  would prove little).
- `write_hf_folder(folder, cfg, tensors, ...)`: a Hugging Face folder written with the
  `safetensors` package (config.json from `LlamaConfig`), one file or two shards with an index.
- `flax_logits(cfg, tensors, tokens)`: `FlaxLlamaForCausalLM` of transformers 4.47.1 on those
  weights. Its RoPE hard-codes base 10000 and has no `rope_scaling`.
- `reference_logits(cfg, tensors, tokens, inv_freq)`: a float64 numpy forward pass of the
  published Llama formulas (RMSNorm, rotate-half RoPE, grouped-query causal attention, SwiGLU),
  for other RoPE bases and Llama 3 scaling; `llama3_inv_freq` is Llama 3.1's frequency rule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
    e, m, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    d = e // cfg.num_attention_heads
    h, k = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (v, e)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (h, e),
            p + "self_attn.k_proj.weight": (k, e),
            p + "self_attn.v_proj.weight": (k, e),
            p + "self_attn.o_proj.weight": (e, h),
            p + "post_attention_layernorm.weight": (e,),
            p + "mlp.gate_proj.weight": (m, e),
            p + "mlp.up_proj.weight": (m, e),
            p + "mlp.down_proj.weight": (e, m),
        })  # fmt: skip
    shapes["model.norm.weight"] = (e,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, e)
    return shapes


def random_tensors(cfg, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            x = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":  # also the head when tied: logits ~ +-5
            x = 0.25 * rng.standard_normal(shape)
        else:  # [out, in]: unit-variance outputs
            x = rng.standard_normal(shape) / math.sqrt(shape[1])
        out[name] = x.astype(np.float32)
    return out


def write_hf_folder(
    folder: Path, cfg, tensors: dict[str, np.ndarray], dtype=np.float32, shards: int = 1
) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    names = list(tensors)
    cast = {n: np.ascontiguousarray(tensors[n].astype(dtype)) for n in names}
    if shards == 1:
        save_file(cast, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    weight_map = {}
    per = -(-len(names) // shards)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: cast[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(a.nbytes for a in cast.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def flax_params(tensors: dict[str, np.ndarray], num_layers: int) -> dict:
    """The parameter tree of PyTorch-named `tensors` (kernels `[in, out]`) that transformers'
    Llama-like Flax models take (FlaxLlamaForCausalLM, FlaxMistralForCausalLM and
    FlaxGemmaForCausalLM name their weights alike)."""
    layers = {}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        layers[str(i)] = {
            "input_layernorm": {"weight": tensors[p + "input_layernorm.weight"]},
            "post_attention_layernorm": {"weight": tensors[p + "post_attention_layernorm.weight"]},
            "self_attn": {
                n: {"kernel": tensors[p + f"self_attn.{n}.weight"].T}
                for n in ("q_proj", "k_proj", "v_proj", "o_proj")
            },
            "mlp": {
                n: {"kernel": tensors[p + f"mlp.{n}.weight"].T}
                for n in ("gate_proj", "up_proj", "down_proj")
            },
        }
    params = {
        "model": {
            "embed_tokens": {"embedding": tensors["model.embed_tokens.weight"]},
            "layers": layers,
            "norm": {"weight": tensors["model.norm.weight"]},
        }
    }
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    params["lm_head"] = {"kernel": head.T}  # unused by the model when tied
    return params


def flax_logits(cfg, tensors: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """FlaxLlamaForCausalLM's float32 logits [B, L, V] (under one `jax.jit`)."""
    import jax
    from transformers import FlaxLlamaForCausalLM

    key = cfg.to_json_string()
    if key not in _FLAX_RUNS:
        model = FlaxLlamaForCausalLM(cfg, _do_init=False)
        _FLAX_RUNS[key] = jax.jit(lambda params, ids: model(ids, params=params).logits)
    params = flax_params(tensors, cfg.num_hidden_layers)
    return np.asarray(_FLAX_RUNS[key](params, np.asarray(tokens)))


_FLAX_RUNS: dict = {}  # one jitted model per config


# ---------------------------------------------------------------------- float64 reference


def default_inv_freq(theta: float, head_dim: int) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def llama3_inv_freq(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """Llama 3.1's rule (Meta's `apply_scaling`), one frequency at a time."""
    out = []
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    for freq in default_inv_freq(theta, head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def reference_logits(cfg, tensors, tokens: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """float64 logits [B, L, V] of the Llama forward pass (see the module docstring)."""
    t = {n: a.astype(np.float64) for n, a in tensors.items()}
    b, length = tokens.shape
    h, k = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // h
    eps = cfg.rms_norm_eps
    angles = np.arange(length)[:, None] * inv_freq[None, :]  # [L, D/2]
    cos = np.cos(np.concatenate([angles, angles], -1))[None, :, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[None, :, None, :]
    causal = np.tril(np.ones((length, length), bool))
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        y = _rms_norm(x, t[p + "input_layernorm.weight"], eps)
        q = (y @ t[p + "self_attn.q_proj.weight"].T).reshape(b, length, h, d)
        kk = (y @ t[p + "self_attn.k_proj.weight"].T).reshape(b, length, k, d)
        v = (y @ t[p + "self_attn.v_proj.weight"].T).reshape(b, length, k, d)
        q = q * cos + _rotate_half(q) * sin
        kk = kk * cos + _rotate_half(kk) * sin
        kk, v = np.repeat(kk, h // k, axis=2), np.repeat(v, h // k, axis=2)
        scores = np.einsum("blhd,bmhd->bhlm", q, kk) / math.sqrt(d)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = np.einsum("bhlm,bmhd->blhd", probs, v).reshape(b, length, h * d)
        x = x + ctx @ t[p + "self_attn.o_proj.weight"].T
        y = _rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
        gate = y @ t[p + "mlp.gate_proj.weight"].T
        up = y @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, t["model.norm.weight"], eps)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return x @ head.T


def cross_entropy(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
    """Mean token loss over the masked positions, in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return float(-(picked * mask).sum() / mask.sum())
