"""MaxText's keys and their semantics: base_* model keys and global_parameter_scale, decoder
block names, hardware values, batch and microbatch derivation, pipeline repeats, DCN axes and
the hybrid mesh (the config package's MaxText compatibility, `MaxText/config/maxtext_compat.py`)."""

from __future__ import annotations

import pytest
from small_model import BASE_MODEL

from MaxText.cluster import processes
from MaxText.config import (
    CONFIGS_DIR,
    Config,
    ConfigError,
    load_config,
)

BASE = str(CONFIGS_DIR / "base.yml")


def load(*overrides: str) -> Config:
    return load_config([BASE, *overrides])


@pytest.mark.parametrize(
    "scale, expected",
    [
        # (emb_dim, query heads, kv heads, mlp_dim, layers), by hand from MaxText's rule: log2 of
        # the scale doubles heads+mlp, then emb, then layers, in turn
        (1, (64, 4, 2, 96, 2)),
        (2, (64, 8, 4, 192, 2)),
        (4, (128, 8, 4, 192, 2)),
        (8, (128, 8, 4, 192, 4)),
        (16, (128, 16, 8, 384, 4)),
    ],
)
def test_base_model_keys_and_global_parameter_scale(scale, expected):
    c = load(*BASE_MODEL, f"global_parameter_scale={scale}")
    got = (c.emb_dim, c.num_query_heads, c.num_kv_heads, c.mlp_dim, c.num_decoder_layers)
    assert got == expected and c.head_dim == 16


def test_base_model_key_errors():
    with pytest.raises(ConfigError, match="global_parameter_scale=3 must be a power of 2"):
        load("global_parameter_scale=3")
    with pytest.raises(ConfigError, match="emb_dim and base_emb_dim are the same key and disagree"):
        load("emb_dim=64", "base_emb_dim=32")


def test_maxtext_decoder_block_names():
    assert load("decoder_block=llama2").decoder_block == "llama"
    assert load("decoder_block=mistral").decoder_block == "mistral"  # its own family now
    assert load("decoder_block=gpt3").decoder_block == "gpt"


def test_hardware_values():
    assert load("hardware=cpu").hardware == "cpu"
    with pytest.raises(ConfigError, match="^not supported here: hardware=tpu: "):
        load("hardware=tpu")
    with pytest.raises(ConfigError, match="no srun or mpirun started this one"):
        processes.for_config(load("hardware=gpu_multiprocess"), environ={})


def test_per_device_batch_size_counts_every_device():
    """MaxText: global batch = per_device_batch_size x all devices x gradient accumulation."""
    assert load("pipeline_parallelism=4").global_batch_size == 4 * 4
    assert load("ici_tensor_parallelism=2", "num_kv_heads=2").global_batch_size == 4 * 2
    c = load("pipeline_parallelism=4", "per_device_batch_size=0.5", "num_pipeline_microbatches=2")
    assert (c.global_batch_size, c.microbatch_size) == (2, 1)
    with pytest.raises(ConfigError, match="= 1.2 rows is not a whole number"):
        load("pipeline_parallelism=4", "per_device_batch_size=0.3")
    assert load("global_batch_size=8", "pipeline_parallelism=4").global_batch_size == 8


def test_gradient_accumulation_multiplies_batch_and_microbatches():
    c = load("gradient_accumulation_steps=2")
    assert (c.global_batch_size, c.num_pipeline_microbatches, c.microbatch_size) == (8, 2, 4)
    c = load("gradient_accumulation_steps=2", "pipeline_parallelism=2")
    assert (c.global_batch_size, c.num_pipeline_microbatches, c.microbatch_size) == (16, 8, 2)


def test_pipeline_repeats_from_maxtext_keys():
    c = load(
        "pipeline_parallelism=2",
        "num_decoder_layers=8",
        "num_layers_per_pipeline_stage=2",
        "pipeline_schedule=interleaved_1f1b",
    )
    assert (c.num_pipeline_repeats, c.num_stages, c.stage_layers) == (2, 4, (2, 2, 2, 2))
    with pytest.raises(ConfigError, match="num_layers_per_pipeline_stage=3 x 2 pipeline groups"):
        load("pipeline_parallelism=2", "num_decoder_layers=8", "num_layers_per_pipeline_stage=3")
    derived = {  # num_pipeline_repeats=-1: MaxText's one layer per virtual stage where it applies
        "interleaved_1f1b": 2,
        "dualpipev": 2,
        "1f1b": 1,
    }
    for schedule, repeats in derived.items():
        c = load(
            "pipeline_parallelism=2", "num_pipeline_repeats=-1", f"pipeline_schedule={schedule}"
        )
        assert c.num_pipeline_repeats == repeats, schedule
    assert load("num_pipeline_repeats=-1").num_pipeline_repeats == 1


def test_dcn_axes_span_processes():
    multi = ["coordinator_address=127.0.0.1:1", "num_processes=2", "process_id=0"]
    c = load(*multi, "dcn_data_parallelism=2", "ici_fsdp_parallelism=4")
    assert (c.mesh_data, c.mesh_fsdp, c.num_devices, c.global_batch_size) == (2, 4, 8, 32)
    assert c.uses_dcn and load(*multi, "dcn_fsdp_parallelism=-1").dcn_fsdp_parallelism == 2
    c = load(*multi, "dcn_pipeline_parallelism=2", "ici_pipeline_parallelism=2")
    assert c.is_pipelined and c.mesh_pipeline == 4 and c.num_stages == 4
    with pytest.raises(ConfigError, match="spans 4 processes but num_processes=2"):
        load(*multi, "dcn_data_parallelism=4")
    with pytest.raises(ConfigError, match="keeps each pipeline group on one process"):
        load(*multi, "dcn_data_parallelism=2", "pipeline_parallelism=2")


class _FakeDevice:
    def __init__(self, i, process):
        self.id, self.process_index, self.platform, self.device_kind = i, process, "cpu", "cpu"

    def __repr__(self):
        return f"d{self.id}@p{self.process_index}"


def test_hybrid_mesh_puts_dcn_axes_across_processes():
    from MaxText.sharding import mesh_device_array

    devices = [_FakeDevice(i, i // 4) for i in range(8)]  # 2 processes x 4 devices
    multi = ["coordinator_address=127.0.0.1:1", "num_processes=2", "process_id=0"]
    spmd = mesh_device_array(
        load(*multi, "dcn_data_parallelism=2", "ici_fsdp_parallelism=4"), devices
    )
    assert spmd.shape == (2, 4, 1)  # (data, fsdp, tensor): data = the process
    assert [[d.process_index for d in row.flat] for row in spmd] == [[0] * 4, [1] * 4]
    pipelined = mesh_device_array(
        load(
            *multi,
            "dcn_pipeline_parallelism=2",
            "ici_pipeline_parallelism=2",
            "ici_fsdp_parallelism=2",
        ),
        devices,
    )
    assert pipelined.shape == (4, 1, 2, 1)  # (stage, data, fsdp, tensor)
    # every pipeline group on one process; groups 0-1 on process 0, 2-3 on process 1
    assert [{d.process_index for d in group.flat} for group in pipelined] == [{0}, {0}, {1}, {1}]


def test_other_maxtext_keys():
    c = load("model_name=small", "override_model_config=false", "emb_dim=64", "head_dim=8")
    assert c.emb_dim == 64  # the command line wins over the preset whatever the flag says
    assert (
        load("seed=3").init_weights_seed == 3 and load("init_weights_seed=5").init_weights_seed == 5
    )
    assert load().mu_dtype == "float32" and load("mu_dtype=bfloat16").mu_dtype == "bfloat16"
    assert load("metrics_file=/tmp/m.jsonl").metrics_file == "/tmp/m.jsonl"
    assert load("opt_type=adafactor").opt_type == "adafactor"
    with pytest.raises(ConfigError, match="opt_type=muon is not one of adamw | adam | sgd"):
        load("opt_type=muon")
