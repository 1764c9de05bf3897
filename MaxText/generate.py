"""Print a sample from a run's latest checkpoint.

    python -m MaxText.generate configs/base.yml run_name=<run> [prompt="ROMEO:"] [key=value ...]

The parameters come from the newest complete, readable checkpoint of
`{base_output_directory}/{run_name}/checkpoints/` (or of `load_parameters_path=`, a run folder, a
checkpoints folder or one step's folder). The model and data keys are taken from the config saved
in that checkpoint, so `run_name=` alone is enough; keys given on the command line still win.
Checkpoints are layout-independent, so generation runs on one device whatever layout trained it
(parallelism keys on the command line are ignored).

Decoding: the prompt becomes `[bos] + tokens(prompt)` (at most `max_prefill_predict_length`
tokens); tokens are appended one at a time up to `max_predict_length` tokens in all, or until EOS.
Every step runs the model on one fixed-size [1, max_predict_length] buffer: attention is causal, so
the unused tail does not change the logits at the current position, and one compiled program
serves every step (no KV cache; the models this trainer runs on CPU are small).
`decode_sampling_strategy`: greedy | weighted (softmax of logits / decode_sampling_temperature) |
topk (the decode_sampling_top_k largest logits, then weighted); `seed=` seeds the sampling.

stdout gets the prompt and its continuation; logs go to stderr. Exit code 2 for a config error
(no checkpoint, a prompt too long, ...).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from MaxText import exit_codes
from MaxText.checkpoint import manager as checkpointing
from MaxText.cluster import devices
from MaxText.config import Config, ConfigError, load_config
from MaxText.model import Decoder

log = logging.getLogger("MaxText")

# Keys read from the checkpoint's saved config: the model's shape and what builds its tokenizer.
SAVED_KEYS = (
    "model_name",
    *checkpointing.MODEL_KEYS,
    "weight_dtype",
    "normalization_layer_epsilon",
    "rope_max_timescale",
    "max_target_length",
    "dataset_type",
    "dataset_path",
    "dataset_name",
    "train_split",
    "eval_split",
    "tokenizer_path",
    "tokenizer_type",
    "packing",
    "grain_train_files",
    "grain_eval_files",
    "eval_split_fraction",
)
# Generation runs on one device: these keys are forced, whatever the command line says.
ONE_DEVICE = {
    "ici_data_parallelism": 1,
    "ici_fsdp_parallelism": 1,
    "ici_tensor_parallelism": 1,
    "ici_pipeline_parallelism": 1,
    "dcn_data_parallelism": 1,
    "dcn_fsdp_parallelism": 1,
    "dcn_tensor_parallelism": 1,
    "dcn_pipeline_parallelism": 1,
    "num_layers_per_pipeline_stage": 0,
    "gradient_accumulation_steps": 1,
    "global_parameter_scale": 1,  # the checkpoint's model keys are already scaled
    "num_pipeline_repeats": 1,
    "num_pipeline_microbatches": 1,
    "global_batch_size": 0,
    "per_device_batch_size": 1,
    "num_processes": 1,
    "process_id": 0,
    "coordinator_address": "",
    "enable_checkpointing": False,
}
_IGNORED = {*ONE_DEVICE, "pipeline_parallelism"}


def _token(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    return f"{key}={value}"


def generation_config(argv: Sequence[str]) -> tuple[Config, str]:
    """The config to sample with (model keys from the checkpoint) and the checkpoint path."""
    cli = load_config(argv)
    source = cli.load_parameters_path or cli.output_dir
    step, saved = checkpointing.saved_config(source)
    user = [t for t in argv[1:] if t.split("=", 1)[0].strip() not in _IGNORED]
    from_checkpoint = [_token(k, saved[k]) for k in SAVED_KEYS if k in saved]
    forced = [_token(k, v) for k, v in ONE_DEVICE.items()]
    config = load_config([argv[0], *from_checkpoint, *user, *forced])
    del step
    return config, source


def make_sampler(config: Config, model: Decoder, vocab_limit: int, banned: Sequence[int]):
    """A jitted (params, tokens_1xT, t, key) -> the token to put at position t."""
    strategy = config.decode_sampling_strategy
    temperature = max(config.decode_sampling_temperature, 1e-6)
    mask_V = np.zeros((config.vocab_size,), np.float32)
    mask_V[vocab_limit:] = -np.inf  # ids the tokenizer cannot decode (a padded model vocab)
    for i in banned:
        if 0 <= i < config.vocab_size:
            mask_V[i] = -np.inf

    @jax.jit
    def sample(params, tokens_1xT, t, key):
        logits_1xTxV = model.apply({"params": params}, tokens_1xT)
        logits_V = jax.lax.dynamic_index_in_dim(logits_1xTxV[0], t - 1, keepdims=False)
        logits_V = logits_V + mask_V
        if strategy == "greedy":
            return jnp.argmax(logits_V).astype(jnp.int32)
        if strategy == "topk":
            k = min(config.decode_sampling_top_k, config.vocab_size)
            top, ids = jax.lax.top_k(logits_V, k)
            return ids[jax.random.categorical(key, top / temperature)].astype(jnp.int32)
        return jax.random.categorical(key, logits_V / temperature).astype(jnp.int32)

    return sample


def generate(config: Config, params: Any, tokenizer: Any, prompt: str) -> str:
    """The prompt followed by its sampled continuation, as text."""
    model = Decoder(config)
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    prompt_ids = bos + list(tokenizer.encode(prompt))
    if len(prompt_ids) > config.max_prefill_predict_length:
        raise ConfigError(
            f"the prompt is {len(prompt_ids)} tokens but max_prefill_predict_length="
            f"{config.max_prefill_predict_length}; shorten it or raise max_prefill_predict_length"
        )
    length = config.max_predict_length
    if config.decoder_block == "gpt" and length > config.max_target_length:
        raise ConfigError(
            f"max_predict_length={length} exceeds the {config.max_target_length} learned positions "
            f"of decoder_block=gpt; use max_predict_length <= {config.max_target_length}"
        )
    banned = [i for i in (tokenizer.pad_id, tokenizer.bos_id) if i >= 0]
    sample = make_sampler(config, model, min(tokenizer.vocab_size, config.vocab_size), banned)
    tokens = np.full((1, length), tokenizer.pad_id, np.int32)
    tokens[0, : len(prompt_ids)] = prompt_ids
    key = jax.random.key(config.seed)
    t = len(prompt_ids)
    while t < length:
        token = int(sample(params, tokens, t, jax.random.fold_in(key, t)))
        if token == tokenizer.eos_id:
            break
        tokens[0, t] = token
        t += 1
    return tokenizer.decode([int(i) for i in tokens[0, len(bos) : t]])


def abstract_params(config: Config) -> Any:
    model = Decoder(config)
    tokens = jnp.zeros((1, config.max_target_length), jnp.int32)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))
    return nn.unbox(boxed)["params"]


def main(argv: Sequence[str]) -> int:
    """Entry point; returns the exit code (`MaxText/exit_codes.py`)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    return exit_codes.run(lambda: _generate(argv))


def _generate(argv: Sequence[str]) -> int:
    try:
        config, source = generation_config(argv)
        devices.setup(**config.device_args())
        from MaxText.data import make_data

        tokenizer = make_data(config).tokenizer
        params, restored = checkpointing.load_params(source, abstract_params(config), config)
        params = jax.device_put(params, jax.devices()[0])
        text = generate(config, params, tokenizer, config.prompt)
    except ValueError as e:  # e.g. a prompt the tokenizer cannot encode
        if exit_codes.exit_code_of(e) is not None:
            raise  # config, data and path errors: their own line (exit_codes.run)
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USER_ERROR
    log.info(
        "generated from checkpoint step %d (%s) with %s decoding",
        restored.step,
        restored.directory,
        config.decode_sampling_strategy,
    )
    print(text, flush=True)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
