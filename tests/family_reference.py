"""The independent reference of the family tests (nothing here imports MaxText): Hugging Face
folders of random small models, and a float64 numpy forward pass of each family written from the
published formulas with Hugging Face's tensor names.

Modeling files followed (PyTorch, eager attention path):
- Llama, Mistral, Qwen 2, Gemma 2: transformers 4.47.1 (`models/<family>/modeling_<family>.py`);
- Qwen 3: transformers commit 9ee3f431c32e9e5f6c0888f6b2b0ca3f6c289dd6 (4.47.1 has no Qwen 3);
- Mixtral: 4.47.1's `modeling_mixtral.py` (`MixtralSparseMoeBlock`); Qwen3-MoE: the Qwen 3
  commit's `modeling_qwen3_moe.py` (`Qwen3MoeSparseMoeBlock`).
Gemma 1 (`model_type` gemma: Gemma 2's (1 + w) norms, embedding scale and GeGLU without its
post-norms, soft caps and windows) is here only to check these formulas against transformers
4.47.1's `FlaxGemmaForCausalLM`; `flax_logits` runs that and `FlaxMistralForCausalLM`.

The formulas, per layer (x the residual stream, `norm` RMSNorm: x / sqrt(mean(x^2) + eps) * w,
Gemma's `* (1 + w)`):
    y = norm(x, input_layernorm)
    q, k, v = y Wq^T (+ bq), y Wk^T (+ bk), y Wv^T (+ bv)      (biases: Qwen 2)
    q, k = norm_D(q, q_norm), norm_D(k, k_norm)                (Qwen 3: per head, over D)
    q, k = rope(q), rope(k)                                    (rotate_half, base rope_theta)
    s = q k^T * scale    scale = D^-0.5, Gemma 2: query_pre_attn_scalar^-0.5
    s = cap tanh(s / cap)                                      (Gemma 2: attn_logit_softcapping)
    mask: k <= q, and q - k < W on windowed layers (W = sliding_window; Mistral: every layer,
          Gemma 2: layers i with i % 2 == 0)
    a = softmax(s) v Wo^T;  a = norm(a, post_attention_layernorm)        (Gemma 2)
    x = x + a
    y = norm(x, post_attention_layernorm (Llama-like) | pre_feedforward_layernorm (Gemma 2))
    f = (act(y Wg^T) * y Wu^T) Wd^T   act: silu, Gemma 2: tanh-approximated GELU
    (MoE: p = softmax(y Wr^T) over the E experts, the k largest p_e and their experts e_j,
     w_j = p_{e_j} / sum_j p_{e_j} (Mixtral always, Qwen3-MoE when norm_topk_prob) else p_{e_j},
     f = sum_j w_j (silu(y W1_{e_j}^T) * y W3_{e_j}^T) W2_{e_j}^T)
    f = norm(f, post_feedforward_layernorm)                                 (Gemma 2)
    x = x + f
and around the layers: x0 = embed[tokens] (Gemma 2: x sqrt(hidden_size)), logits =
norm(x, model.norm) head^T (head = lm_head, or the embedding when tied), Gemma 2:
cap tanh(logits / cap) with final_logit_softcapping.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

GEMMA = ("gemma", "gemma2")  # (1 + w) norms, embeddings x sqrt(hidden), GeGLU (Gemma 1 and 2)
MOE = ("mixtral", "qwen3_moe")


def hf_config(family: str, **overrides) -> dict:
    """A small config.json dict of `family` (architectures, model_type and the fields its
    modeling file reads)."""
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, hidden_act="silu", initializer_range=0.02,
        attention_dropout=0.0, use_cache=True, torch_dtype="float32",
    )  # fmt: skip
    per_family = {
        "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
        "mistral": dict(
            architectures=["MistralForCausalLM"], model_type="mistral", head_dim=16,
            sliding_window=5, rope_theta=1000000.0, transformers_version="4.42.0.dev0",
        ),
        "qwen2": dict(
            architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True,
            use_sliding_window=False, sliding_window=131072, max_window_layers=2,
            rms_norm_eps=1e-6, rope_theta=1000000.0, transformers_version="4.43.1",
        ),
        "gemma2": dict(
            architectures=["Gemma2ForCausalLM"], model_type="gemma2", num_hidden_layers=3,
            head_dim=16, query_pre_attn_scalar=24, sliding_window=5, sliding_window_size=5,
            attn_logit_softcapping=10.0, final_logit_softcapping=15.0, tie_word_embeddings=True,
            hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
            attention_bias=False, cache_implementation="hybrid", rms_norm_eps=1e-6,
            pad_token_id=0, transformers_version="4.42.0.dev0",
        ),
        "gemma": dict(
            architectures=["GemmaForCausalLM"], model_type="gemma", head_dim=16,
            hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, rms_norm_eps=1e-6,
        ),
        "qwen3": dict(
            architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16,
            attention_bias=False, use_sliding_window=False, sliding_window=None,
            max_window_layers=2, rope_scaling=None, rms_norm_eps=1e-6, rope_theta=1000000.0,
            transformers_version="4.51.0",
        ),
        "mixtral": dict(
            architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
            num_experts_per_tok=2, sliding_window=None, rope_theta=1000000.0,
            output_router_logits=False, router_aux_loss_coef=0.02, router_jitter_noise=0.0,
            transformers_version="4.47.1",
        ),
        "qwen3_moe": dict(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
            attention_bias=False, use_sliding_window=False, sliding_window=None,
            max_window_layers=2, rope_scaling=None, rms_norm_eps=1e-6, rope_theta=1000000.0,
            output_router_logits=False, router_aux_loss_coef=0.001,
            transformers_version="4.51.0",
        ),
    }  # fmt: skip
    cfg = {**common, **per_family[family]}
    cfg.update(overrides)
    return cfg


def family_of(cfg: dict) -> str:
    return cfg["model_type"]


def experts(cfg: dict) -> tuple[int, int, int]:
    """(experts E, experts per token k, expert width) of a MoE config."""
    if family_of(cfg) == "mixtral":
        return cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]
    return cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]


def _expert_names(cfg: dict, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
    """(router name, per expert (gate, up, down) names) of one MoE layer."""
    p = f"model.layers.{layer}."
    count = experts(cfg)[0]
    if family_of(cfg) == "mixtral":
        e = p + "block_sparse_moe.experts.{}."
        return p + "block_sparse_moe.gate.weight", [
            tuple((e + w).format(j) for w in ("w1.weight", "w3.weight", "w2.weight"))
            for j in range(count)
        ]
    e = p + "mlp.experts.{}."
    return p + "mlp.gate.weight", [
        tuple(
            (e + w).format(j) for w in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
        )  # fmt: skip
        for j in range(count)
    ]


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> PyTorch shape of every tensor of `cfg`'s model."""
    e, m, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = head_dim(cfg)
    h, k = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    family = family_of(cfg)
    shapes = {"model.embed_tokens.weight": (v, e)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (h, e),
            p + "self_attn.k_proj.weight": (k, e),
            p + "self_attn.v_proj.weight": (k, e),
            p + "self_attn.o_proj.weight": (e, h),
            p + "post_attention_layernorm.weight": (e,),
        })  # fmt: skip
        if family in MOE:
            count, _, f = experts(cfg)
            router, names = _expert_names(cfg, i)
            shapes[router] = (count, e)
            for gate, up, down in names:
                shapes.update({gate: (f, e), up: (f, e), down: (e, f)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (m, e), p + "mlp.up_proj.weight": (m, e),
                           p + "mlp.down_proj.weight": (e, m)})  # fmt: skip
        if family == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (h,), p + "self_attn.k_proj.bias": (k,),
                           p + "self_attn.v_proj.bias": (k,)})  # fmt: skip
        if family in ("qwen3", "qwen3_moe"):
            shapes.update({p + "self_attn.q_norm.weight": (d,),
                           p + "self_attn.k_norm.weight": (d,)})  # fmt: skip
        if family == "gemma2":
            shapes.update({p + "pre_feedforward_layernorm.weight": (e,),
                           p + "post_feedforward_layernorm.weight": (e,)})  # fmt: skip
    shapes["model.norm.weight"] = (e,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, e)
    return shapes


def random_tensors(cfg: dict, seed: int, embed_std: float = 0.25) -> dict[str, np.ndarray]:
    """float32 weights scaled so the logits are O(1) (Hugging Face's init, std 0.02, gives logits
    ~1e-2, where a 1e-5 tolerance would prove little). Gemma's norms store w of (1 + w).
    A small `embed_std` (untied head) makes the first norm's eps matter."""
    rng = np.random.default_rng(seed)
    offset = 0.0 if family_of(cfg) in GEMMA else 1.0
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            x = offset + 0.2 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            x = 0.5 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":  # also the head when tied: logits ~ +-5
            x = embed_std * rng.standard_normal(shape)
        else:  # [out, in]: unit-variance outputs
            x = rng.standard_normal(shape) / math.sqrt(shape[1])
        out[name] = x.astype(np.float32)
    return out


def write_hf_folder(folder: Path, cfg: dict, tensors: dict[str, np.ndarray]) -> Path:
    """config.json (as given) and one model.safetensors (the `safetensors` package)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    cast = {n: np.ascontiguousarray(a) for n, a in tensors.items()}
    save_file(cast, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# ---------------------------------------------------------------------- float64 forward pass


def _rms_norm(x, w, eps, offset):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + w)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def layer_window(cfg: dict, layer: int) -> int:
    """The window W of `layer` (0: global): q attends k with q - W < k <= q."""
    family = family_of(cfg)
    if family == "mistral":
        return cfg.get("sliding_window") or 0
    if family == "gemma2":
        return cfg["sliding_window"] if layer % 2 == 0 else 0
    return 0


def mask(length: int, window: int) -> np.ndarray:
    q, k = np.arange(length)[:, None], np.arange(length)[None, :]
    allowed = k <= q
    if window:
        allowed &= q - k < window
    return allowed


def reference_logits(cfg: dict, tensors, tokens: np.ndarray, skip=(), router=None) -> np.ndarray:
    """float64 logits [B, L, V] of `cfg`'s model (see the module docstring). `skip` drops or
    changes named steps so a test can show each one matters: "window" (none), "window+1" (W + 1
    keys), "qk_norm", "softcap" (both caps), "bias" (Qwen 2's), "norm_offset" (Gemma's w for
    1 + w), "topk_norm" (the MoE weights not renormalised). A MoE model appends each layer's
    router probabilities [B*L, E] to the list `router` when one is given."""
    t = {n: a.astype(np.float64) for n, a in tensors.items()}
    family = family_of(cfg)
    gemma, gemma2 = family in GEMMA, family == "gemma2"
    offset = 1.0 if gemma and "norm_offset" not in skip else 0.0
    b, length = tokens.shape
    h, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    eps = cfg["rms_norm_eps"] if "eps" not in skip else 1e-5  # base.yml's, if unmapped
    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.arange(length)[:, None] * inv_freq[None, :]  # [L, D/2]
    cos = np.cos(np.concatenate([angles, angles], -1))[None, :, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[None, :, None, :]
    scale = (cfg["query_pre_attn_scalar"] if gemma2 else d) ** -0.5
    attn_cap = cfg.get("attn_logit_softcapping") if "softcap" not in skip else None
    act = _gelu_tanh if gemma else (lambda z: z / (1 + np.exp(-z)))

    def norm(x, name):
        return _rms_norm(x, t[name], eps, offset)

    x = t["model.embed_tokens.weight"][tokens]
    if gemma:
        x = x * math.sqrt(cfg["hidden_size"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def proj(name, y, p=p):
            out = y @ t[p + f"self_attn.{name}_proj.weight"].T
            if family == "qwen2" and "bias" not in skip:
                out = out + t[p + f"self_attn.{name}_proj.bias"]
            return out

        y = norm(x, p + "input_layernorm.weight")
        q = proj("q", y).reshape(b, length, h, d)
        k = proj("k", y).reshape(b, length, kv, d)
        v = proj("v", y).reshape(b, length, kv, d)
        if family in ("qwen3", "qwen3_moe") and "qk_norm" not in skip:
            q = _rms_norm(q, t[p + "self_attn.q_norm.weight"], eps, 0.0)
            k = _rms_norm(k, t[p + "self_attn.k_norm.weight"], eps, 0.0)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = np.repeat(k, h // kv, axis=2), np.repeat(v, h // kv, axis=2)
        scores = np.einsum("blhd,bmhd->bhlm", q, k) * scale
        if attn_cap:
            scores = attn_cap * np.tanh(scores / attn_cap)
        window = layer_window(cfg, i) if "window" not in skip else 0
        if window and "window+1" in skip:  # FlashAttention-2's (and Flax Mistral's) W + 1 keys
            window += 1
        scores = np.where(mask(length, window), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        a = np.einsum("bhlm,bmhd->blhd", probs, v).reshape(b, length, h * d)
        a = a @ t[p + "self_attn.o_proj.weight"].T
        if gemma2:
            a = norm(a, p + "post_attention_layernorm.weight")
        x = x + a
        y = norm(x, p + ("pre_feedforward_layernorm.weight" if gemma2
                         else "post_attention_layernorm.weight"))  # fmt: skip
        if family in MOE:
            f = _moe(cfg, t, i, y, act, "topk_norm" not in skip, router)
        else:
            gate = y @ t[p + "mlp.gate_proj.weight"].T
            f = (act(gate) * (y @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
        if gemma2:
            f = norm(f, p + "post_feedforward_layernorm.weight")
        x = x + f
    x = norm(x, "model.norm.weight")
    logits = x @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T
    final_cap = cfg.get("final_logit_softcapping") if "softcap" not in skip else None
    if final_cap:
        logits = final_cap * np.tanh(logits / final_cap)
    return logits


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _moe(cfg: dict, t: dict, layer: int, y, act, renormalise: bool, router):
    """The sparse MoE block of one layer on y [B, L, E] (float64)."""
    count, k, _ = experts(cfg)
    router_name, names = _expert_names(cfg, layer)
    rows = y.reshape(-1, y.shape[-1])
    probs = _softmax(rows @ t[router_name].T)
    if router is not None:
        router.append(probs)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, axis=-1)
    if renormalise and (family_of(cfg) == "mixtral" or cfg.get("norm_topk_prob")):
        w = w / w.sum(-1, keepdims=True)
    out = np.zeros_like(rows)
    for e, (gate, up, down) in enumerate(names):
        token, slot = np.nonzero(ids == e)
        if token.size:
            x = rows[token]
            h = act(x @ t[gate].T) * (x @ t[up].T)
            out[token] += w[token, slot, None] * (h @ t[down].T)
    return out.reshape(y.shape)


def router_margin(router: list, k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th router probability of any token in any
    layer: above float32 rounding, float32 and float64 route alike."""
    gaps = [np.min(-np.diff(-np.sort(-p, axis=-1)[:, k - 1 : k + 1], axis=-1)) for p in router]
    return float(min(gaps))


def cross_entropy(logits: np.ndarray, targets: np.ndarray, mask_: np.ndarray) -> float:
    """Mean token loss over the masked positions, in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return float(-(picked * mask_).sum() / mask_.sum())


# ---------------------------------------------------------------------- the Flax models


def flax_logits(cfg: dict, tensors: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """transformers 4.47.1's FlaxMistralForCausalLM or FlaxGemmaForCausalLM (Gemma 1) on the
    PyTorch-named `tensors` (kernels transposed to Flax's [in, out]); float32 logits [B, L, V].
    Both hard-code RoPE base 10000; Flax Mistral's mask (`triu(k=-W)`) attends W + 1 keys."""
    import jax
    from hf_reference import flax_params
    from transformers import (
        FlaxGemmaForCausalLM,
        FlaxMistralForCausalLM,
        GemmaConfig,
        MistralConfig,
    )

    kind = {"mistral": (MistralConfig, FlaxMistralForCausalLM),
            "gemma": (GemmaConfig, FlaxGemmaForCausalLM)}[family_of(cfg)]  # fmt: skip
    config = kind[0](**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = kind[1](config, _do_init=False)
    params = flax_params(tensors, cfg["num_hidden_layers"])
    run = jax.jit(lambda params, ids: model(ids, params=params).logits)
    return np.asarray(run(params, np.asarray(tokens)))
