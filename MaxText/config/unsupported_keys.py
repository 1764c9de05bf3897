"""MaxText keys and values this trainer does not implement, each with the reason (data, read by
the loader).

A MaxText user's command that sets one of these stops with one line,
`config error: not supported here: <key> (<where>): <reason>`, instead of a suggestion of some
unrelated key. A key listed here that the config later implements is simply a key (the config's
own keys are looked up first), so this table never hides a working key; keep it in step anyway.
docs/coming_from_maxtext.md, "MaxText keys not supported here", lists the same keys and reasons.
"""

from __future__ import annotations

_MOE = "there are no mixture-of-experts layers here"
_CONTEXT = "sequence/context parallelism is not implemented (batch, fsdp, tensor, pipeline are)"
_SPMD_PP = (
    "a knob of MaxText's SPMD (vmap-over-stages) pipeline; here pipelining is MPMD "
    "(pipeline_schedule=..., one program per stage)"
)
_QUANT = "quantization (AQT/Qwix/fp8) is not implemented; use dtype=bfloat16"
_CLOUD = "Google Cloud integration is not part of this trainer"
_EMERGENCY = (
    "only orbax checkpoints under base_output_directory (async, keep-N, resume by run_name)"
)
_DATA = "dataset_type=hf is not implemented (text, synthetic, tfds, grain are)"
_AOT = (
    "ahead-of-time compilation for another topology is not implemented; the step is "
    "compiled before the first step on the devices present"
)
_MESH = "the mesh is built from the parallelism keys and the fixed rules in MaxText/sharding.py"

UNSUPPORTED: dict[str, str] = {
    # parallelism axes this trainer does not have
    **{
        f"{scope}_{axis}_parallelism": reason
        for scope in ("ici", "dcn")
        for axis, reason in (
            ("fsdp_transpose", "the fsdp_transpose axis is not implemented; use fsdp"),
            ("sequence", _CONTEXT),
            ("context", _CONTEXT),
            ("context_autoregressive", _CONTEXT),
            ("tensor_transpose", "the tensor_transpose axis is not implemented; use tensor"),
            ("tensor_sequence", _CONTEXT),
            ("expert", _MOE),
            (
                "autoregressive",
                "there is no serving engine here (MaxText.generate runs greedy/topk)",
            ),
            ("diloco", "DiLoCo training is not implemented"),
        )
    },
    "context_parallel_load_balance": _CONTEXT,
    "context_parallel_strategy": _CONTEXT,
    "num_slices": "processes are set with num_processes; dcn_*_parallelism spans them",
    "mesh_axes": _MESH,
    "logical_axis_rules": _MESH,
    "data_sharding": _MESH,
    "custom_mesh_and_rule": _MESH,
    "shard_mode": "sharding is automatic (jax.jit shardings from the logical-axis rules)",
    "allow_split_physical_axes": _MESH,
    # MaxText's SPMD pipeline
    "pipeline_parallel_layers": "every decoder layer is pipelined; uneven layer counts are fine",
    "pipeline_delay_activation_forwarding": _SPMD_PP,
    "pipeline_fsdp_ag_per_repeat": _SPMD_PP,
    "scan_pipeline_iterations": _SPMD_PP,
    "scan_pipeline_repeats": _SPMD_PP,
    "scan_layers_per_stage": _SPMD_PP,
    "set_remat_policy_on_pipeline_iterations": _SPMD_PP,
    "set_remat_policy_on_layers_per_stage": _SPMD_PP,
    # model features
    "num_experts": _MOE,
    "num_experts_per_tok": _MOE,
    "megablox": _MOE,
    "sparse_matmul": _MOE,
    "capacity_factor": _MOE,
    "load_balance_loss_weight": _MOE,
    "shared_experts": _MOE,
    "attention_type": "set by the family: decoder_block=mistral and gemma2 attend locally "
    "within sliding_window_size (Gemma 2: its even layers); chunked and MLA attention are not "
    "implemented",
    "rope_min_timescale": "RoPE frequencies start at 1 (rope_max_timescale sets the base)",
    "fused_qkv": "separate q/k/v projections only",
    "fused_mlp": "separate mlp projections only",
    "enable_dropout": "dropout is not implemented (training is deterministic)",
    "dropout_rate": "dropout is not implemented (training is deterministic)",
    "float32_logits": "logits are computed in dtype and the loss in float32",
    "logits_dot_in_fp32": "logits are computed in dtype and the loss in float32",
    "cast_logits_to_fp32": "logits are computed in dtype and the loss in float32",
    "matmul_precision": "matmuls use JAX's default precision for dtype",
    "grad_dtype": "gradients have the parameters' dtype (weight_dtype)",
    "param_scan_axis": "scanned layer weights are stacked on axis 0",
    "num_vocab_tiling": "vocabulary tiling is not implemented",
    "mtp_num_layers": "multi-token prediction is not implemented",
    "mtp_loss_scaling_factor": "multi-token prediction is not implemented",
    "z_loss_multiplier": "the loss is plain cross-entropy (no z-loss)",
    "use_iota_embed": "the token embedding is a gather",
    "use_untrainable_positional_embedding": "llama uses RoPE, gpt learned positions",
    "trainable_position_size": "gpt's learned positions cover max_target_length",
    "enable_nnx": "the model is written in flax.linen",
    "pure_nnx": "the model is written in flax.linen",
    "pure_nnx_decoder": "the model is written in flax.linen",
    "quantization": _QUANT,
    "quantize_kvcache": _QUANT,
    "kv_quant_axis": _QUANT,
    "kv_quant_dtype": _QUANT,
    "use_qwix_quantization": _QUANT,
    # optimizer and loop
    "lr_schedule_type": "the schedule is linear warmup then cosine decay (then 0)",
    "wsd_decay_steps_fraction": "the schedule is linear warmup then cosine decay (then 0)",
    "wsd_decay_style": "the schedule is linear warmup then cosine decay (then 0)",
    "muon_beta": "opt_type=muon is not implemented (adamw, adam, sgd, adafactor are)",
    "muon_weight_decay": "opt_type=muon is not implemented (adamw, adam, sgd, adafactor are)",
    "optimizer_memory_host_offload": "host offloading is not implemented",
    "parameter_memory_host_offload": "host offloading is not implemented",
    "shard_optimizer_over_data": "ZeRO-1 is not implemented; ici_fsdp_parallelism shards "
    "parameters and optimizer state (ZeRO-3)",
    "skip_step_on_spikes": "every step is applied; a NaN/Inf loss stops the run",
    "abort_on_nan_loss": "always on: a NaN/Inf loss stops the run with the step number",
    "abort_on_inf_loss": "always on: a NaN/Inf loss stops the run with the step number",
    "target_eval_loss": "early stopping on eval loss is not implemented",
    "eval_start_step": "evaluation runs every eval_interval steps and at the end",
    "eval_per_device_batch_size": "evaluation uses the training batch shape",
    "reuse_example_batch": "dataset_type=synthetic generates batches without reading files",
    "enable_rampup_batch_size": "the batch size is fixed for a run",
    "dump_hlo": "use XLA_FLAGS=--xla_dump_to=<dir>",
    "dump_hlo_gcs_dir": "use XLA_FLAGS=--xla_dump_to=<dir>",
    "dump_hlo_xla_flags": "use XLA_FLAGS=--xla_dump_to=<dir>",
    "enable_goodput_recording": _CLOUD,
    "monitor_goodput": _CLOUD,
    "goodput_upload_interval_seconds": _CLOUD,
    "enable_pathways_goodput": _CLOUD,
    "gcs_metrics": _CLOUD,
    "use_vertex_tensorboard": _CLOUD,
    "vertex_tensorboard_project": _CLOUD,
    "vertex_tensorboard_region": _CLOUD,
    "enable_wandb": "metrics go to the console, metrics.jsonl and TensorBoard",
    "enable_single_controller": "multi-controller only (one process per host)",
    "skip_jax_distributed_system": "jax.distributed starts only when num_processes > 1",
    "jax_distributed_initialization_timeout": "JAX's default timeout is used",
    "compile_topology": _AOT,
    "compile_topology_num_slices": _AOT,
    "compiled_trainstep_file": _AOT,
    # checkpoints
    "load_full_state_path": "to continue a run, reuse its run_name; load_parameters_path "
    "starts a new run from another run's parameters",
    "save_checkpoint_on_start": "checkpoints are written every checkpoint_period steps and at "
    "the last step",
    "save_checkpoint_on_completion": "always on: the last step is always saved",
    "checkpoint_storage_use_ocdbt": "always OCDBT + zarr (orbax's defaults)",
    "checkpoint_storage_use_zarr3": "always OCDBT + zarr (orbax's defaults)",
    "checkpoint_storage_target_data_file_size_bytes": "orbax's default file size is used",
    "enable_emergency_checkpoint": _EMERGENCY,
    "local_checkpoint_directory": _EMERGENCY,
    "local_checkpoint_period": _EMERGENCY,
    "enable_multi_tier_checkpointing": _EMERGENCY,
    "enable_autocheckpoint": _EMERGENCY,
    "enable_single_replica_ckpt_restoring": _EMERGENCY,
    # data sources other than text / synthetic / tfds
    "hf_path": _DATA,
    "hf_data_dir": _DATA,
    "hf_train_files": _DATA,
    "hf_eval_split": _DATA,
    "hf_eval_files": _DATA,
    "hf_access_token": _DATA,
    "expansion_factor_real_data": "every process loads its own rows (SPMD) or the whole batch "
    "(pipelined)",
}

# Values of our keys that MaxText (or a user) may give and this trainer does not run, with the
# reason: `config error: not supported here: <key>=<value>: <reason>`.
UNSUPPORTED_VALUES: dict[str, dict[str, str]] = {
    "decoder_block": {
        **{
            name: "mixture-of-experts blocks are not implemented"
            for name in ("mixtral", "deepseek", "llama4", "qwen3_moe", "gpt_oss")
        },
        **{
            name: "this block (its own norms and attention variants) is not implemented"
            for name in (
                "gemma",
                "gemma3",
                "olmo3",
                "simple",
                "simple_mlp",
            )
        },
    },
    "hardware": {
        "tpu": "this trainer is tested on CPU and written for GPU; use hardware=auto (the "
        "accelerator JAX finds), gpu, gpu_multiprocess or cpu",
    },
    "profiler": {
        "nsys": "run train.py under `nsys profile` yourself, or use profiler=xplane",
    },
    "tokenizer_type": {
        "tiktoken": "read Llama 3's tokenizer.json with tokenizer_type=huggingface instead",
    },
}
