"""The small model the trainer tests share (config overrides).

`SMALL_MODEL_SHAPE`: 4 llama layers so that pipeline_parallelism=4 has one layer per stage;
width 32, 64-token vocabulary, 16-token sequences, global batch 8 everywhere. It keeps the
trainer's default layout (`scan_layers: true`): tests of a feature run the default, and the
unrolled layout as a variant (`tests/test_collectives_trainer.py`).

adam_eps=1e-3: Adam divides each gradient by its own running magnitude, so for entries whose
gradient is at rounding-noise level (~1e-9) it turns float32 summation-order noise into full-size
updates; eps=1e-8 then shows 3e-5 relative parameter differences that come from Adam, not from the
layout. A larger eps damps that, so cross-layout comparisons measure the layout.

`SMALL_MODEL`: the same with scan_layers=false, for the layout tests whose bounds were measured
with unrolled layers (pipeline_parallelism=4 has one-layer stages, whose one-trip scans XLA
inlines); scanned layouts are tested in tests/test_scanned_pipeline.py and tests/test_train.py.
"""

SMALL_MODEL_SHAPE = [
    "emb_dim=32",
    "num_query_heads=4",
    "num_kv_heads=2",
    "head_dim=8",
    "mlp_dim=64",
    "num_decoder_layers=4",
    "vocab_size=64",
    "max_target_length=16",
    "max_prefill_predict_length=4",
    "max_predict_length=16",
    "global_batch_size=8",
    "learning_rate=1e-2",
    "adam_eps=1e-3",
]

SMALL_MODEL = ["scan_layers=false", *SMALL_MODEL_SHAPE]

# Tokens per training step of the small model (global_batch_size x max_target_length): the
# number of terms in each sum over the batch (losses, gradients), for tolerance bounds.
SMALL_MODEL_TOKENS = 8 * 16

# MaxText's base_* model keys (scaled by global_parameter_scale) for a small model
BASE_MODEL = [
    "base_emb_dim=64",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "base_mlp_dim=96",
    "base_num_decoder_layers=2",
    "head_dim=16",
]

# One synthetic step of a one-layer model, nothing written but metrics: for tests of what happens
# around a run (process setup, refusals), not of what it computes.
ONE_STEP = [
    "dataset_type=synthetic",
    "num_decoder_layers=1",
    "max_target_length=16",
    "per_device_batch_size=2",
    "steps=1",
    "eval_interval=0",
    "enable_checkpointing=false",
    "enable_tensorboard=false",
    "enable_progress_bar=false",
]


def merged(*tokens: str) -> list[str]:
    """`tokens` (a command line) with a later `key=value` replacing an earlier one of the same
    key, for tests that add their own keys to a shared list: the command line itself refuses a
    key given twice with different values."""
    out: dict[str, str] = {}
    for token in tokens:
        out[token.split("=", 1)[0] if "=" in token else token] = token
    return list(out.values())
