"""The rules between keys, and the values derived from them (each key alone is checked by the
constraints declared on its `Config` field in `loader.py`).

`derive(values)` runs them in order on the checked keys and adds the derived fields: MaxText's
parameter scale, processes, model shape, data, the "auto" defaults, then — unless the devices are
still pending (a -1 ici axis, or processes the launcher will tell) — the mesh (`mesh.py`) and the
pipeline and batch (`pipeline.py`), then the optimizer schedule, generation and output paths.
Every failure is a `ConfigError` naming the keys and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from MaxText.config.maxtext_compat import apply_parameter_scale
from MaxText.config.mesh import DCN_KEYS, PARALLELISM_KEYS, derive_mesh, filled_axis
from MaxText.config.pipeline import auto_defaults, derive_pipeline
from MaxText.errors import ConfigError


def processes_pending(v: Mapping[str, Any]) -> bool:
    """The launcher (srun, mpirun) tells the processes: `num_processes=-1`, or
    `hardware=gpu_multiprocess` without `coordinator_address`."""
    gpu_cluster = v["hardware"] == "gpu_multiprocess" and not v["coordinator_address"]
    return v["num_processes"] == -1 or gpu_cluster


def axes_pending(v: Mapping[str, Any]) -> bool:
    """An ici axis is -1: it takes the devices the others leave (needs the device count)."""
    return any(v[k] == -1 for k in PARALLELISM_KEYS)


def derive(v: dict[str, Any]) -> None:
    apply_parameter_scale(v)
    _processes(v)
    _model_shape(v)
    _data(v)
    _post_training(v)
    _attention(v)
    auto_defaults(v)
    filled_axis({k: v[k] for k in PARALLELISM_KEYS})
    filled_axis({k: v[k] for k in DCN_KEYS})
    if not (processes_pending(v) or axes_pending(v)):
        derive_mesh(v)
        derive_pipeline(v)
        _dpo_pairs(v)

    if v["learning_rate_schedule_steps"] == -1:
        v["learning_rate_schedule_steps"] = v["steps"]
    if v["max_prefill_predict_length"] >= v["max_predict_length"]:
        raise ConfigError(
            f"max_prefill_predict_length={v['max_prefill_predict_length']} must be less than "
            f"max_predict_length={v['max_predict_length']}"
        )
    if "/" in v["run_name"]:
        raise ConfigError(f"run_name={v['run_name']} must not contain '/'")
    v["output_dir"] = os.path.join(v["base_output_directory"], v["run_name"])
    v["metrics_file"] = v["metrics_file"] or os.path.join(v["output_dir"], "metrics.jsonl")
    if v["init_weights_seed"] == -1:
        v["init_weights_seed"] = v["seed"]
    v["mu_dtype"] = v["mu_dtype"] or v["weight_dtype"]


def _processes(v: dict[str, Any]) -> None:
    n, coordinator = v["num_processes"], v["coordinator_address"]
    if v["hardware"] == "gpu_multiprocess" and coordinator and n == 1:
        raise ConfigError(
            "hardware=gpu_multiprocess with coordinator_address= needs num_processes=N "
            "(or -1: the launcher's, srun or mpirun)"
        )
    if n > 1 and not coordinator:
        raise ConfigError(f"num_processes={n} needs coordinator_address=host:port")
    if n != -1 and v["process_id"] >= n:
        raise ConfigError(f"process_id={v['process_id']} must be < num_processes={n}")


def _model_shape(v: dict[str, Any]) -> None:
    if v["head_dim"] == 0:
        if v["emb_dim"] % v["num_query_heads"]:
            raise ConfigError(
                f"head_dim=0 means emb_dim / num_query_heads, but emb_dim={v['emb_dim']} is not "
                f"divisible by num_query_heads={v['num_query_heads']}; set head_dim explicitly"
            )
        v["head_dim"] = v["emb_dim"] // v["num_query_heads"]
    if v["num_query_heads"] % v["num_kv_heads"]:
        raise ConfigError(
            f"num_query_heads={v['num_query_heads']} must be a multiple of "
            f"num_kv_heads={v['num_kv_heads']} (grouped-query attention)"
        )
    _mlp_activations(v)
    low, high = v["rope_low_freq_factor"], v["rope_high_freq_factor"]
    if v["rope_type"] == "llama3.1" and not low < high:
        raise ConfigError(
            f"rope_low_freq_factor={low} and rope_high_freq_factor={high}: need 0 < low < high"
        )


# `mlp_activations` names (MaxText's); MaxText/model/mlp.py implements the same (a test checks).
MLP_ACTIVATIONS = ("silu", "gelu", "relu", "linear")
# gpt's MLP is fixed (GELU with biases): base.yml's default or MaxText's gpt3 value name it.
_GPT_ACTIVATIONS = (("silu", "linear"), ("gelu",))


def _mlp_activations(v: dict[str, Any]) -> None:
    acts = v["mlp_activations"]
    if v["decoder_block"] == "gpt":
        if acts not in _GPT_ACTIVATIONS:
            raise ConfigError(
                f"mlp_activations={list(acts)}: decoder_block=gpt's MLP is GELU with biases "
                "(mlp_activations applies to the gated MLP of the other families); leave it out"
            )
        return
    unknown = [a for a in acts if a not in MLP_ACTIVATIONS]
    if len(acts) != 2 or unknown:
        raise ConfigError(
            f"mlp_activations={list(acts)} must be two of {' | '.join(MLP_ACTIVATIONS)} "
            "(the gated MLP's act0(x W0) * act1(x W1); SwiGLU: [silu, linear])"
        )


def _attention(v: dict[str, Any]) -> None:
    """cudnn_flash's dtype and packed rows (whether it has a GPU: `devices.setup`); the
    jax.nn.dot_product_attention kernels cannot soft-cap."""
    if v["attn_logits_soft_cap"] and v["attention"] in ("cudnn_flash", "autoselected"):
        raise ConfigError(
            f"attention={v['attention']} cannot soft-cap attention logits "
            f"(attn_logits_soft_cap={v['attn_logits_soft_cap']}: jax.nn.dot_product_attention "
            "has no soft cap); use attention=chunked (memory-efficient) or dot_product"
        )
    if v["attention"] == "cudnn_flash" and v["dtype"] == "float32":
        raise ConfigError(
            "attention=cudnn_flash needs dtype=bfloat16 or float16 (cuDNN flash attention has no "
            "float32 kernel); set dtype=bfloat16, or keep float32 with attention=chunked"
        )
    if v["attention"] == "cudnn_flash" and v["dataset_type"] == "grain" and v["packing"]:
        raise ConfigError(
            "attention=cudnn_flash cannot keep packed documents apart (JAX's public API has no "
            "segment ids for it; a [L, L] mask would become a dense bias); use attention=chunked "
            "with packing, or packing=false"
        )


def _data(v: dict[str, Any]) -> None:
    if v["tokenizer_type"] == "huggingface" and not v["tokenizer_path"]:
        raise ConfigError(
            "tokenizer_type=huggingface needs tokenizer_path= (a tokenizer.json file, or the "
            "Hugging Face folder holding it)"
        )
    if v["dataset_type"] == "grain" and not v["grain_train_files"]:
        raise ConfigError(
            "dataset_type=grain needs grain_train_files= (a glob of *.array_record shards written "
            "by python -m MaxText.data.prepare)"
        )
    if v["dataset_type"] == "grain" and v["eval_interval"] > 0 and not v["grain_eval_files"]:
        raise ConfigError(
            f"eval_interval={v['eval_interval']} needs held-out data: set grain_eval_files= (e.g. "
            "the eval-*.array_record of prepare --eval_fraction) or eval_interval=0"
        )
    if not v["train_split"]:
        raise ConfigError("train_split= must name a split (MaxText's default: train)")
    if not v["packing"] and v["dataset_type"] in ("text", "tfds"):
        raise ConfigError(
            f"packing=false is not supported with dataset_type={v['dataset_type']}, which "
            "concatenates documents into windows; use dataset_type=grain for one document per row"
        )


def _post_training(v: dict[str, Any]) -> None:
    """use_sft / use_dpo read prepared chat / preference shards (`prepare --format ...`)."""
    if v["use_sft"] and v["use_dpo"]:
        raise ConfigError("use_sft=true and use_dpo=true: choose one (DPO data has its own format)")
    for key, fmt in (("use_sft", "chat"), ("use_dpo", "preference")):
        if v[key] and v["dataset_type"] != "grain":
            raise ConfigError(
                f"{key}=true reads shards of python -m MaxText.data.prepare --format {fmt}: set "
                f"dataset_type=grain and grain_train_files= (dataset_type={v['dataset_type']})"
            )
    if v["use_chat_template"] and not v["chat_prompt_file"]:
        raise ConfigError(
            "use_chat_template=true needs chat_prompt_file= (a JSON file of messages: "
            '[{"role": "user", "content": "..."}])'
        )


def _dpo_pairs(v: dict[str, Any]) -> None:
    """A preference pair's two rows (2k, 2k + 1) must fall into one microbatch."""
    if v["use_dpo"] and v["microbatch_size"] % 2:
        raise ConfigError(
            f"use_dpo=true needs an even microbatch size (a pair's chosen and rejected rows share "
            f"a microbatch), but global_batch_size={v['global_batch_size']} / "
            f"{v['num_pipeline_microbatches']} microbatches = {v['microbatch_size']}; use an even "
            "global_batch_size / num_pipeline_microbatches"
        )
