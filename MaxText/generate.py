"""Print a sample from a run's latest checkpoint.

    python -m MaxText.generate configs/base.yml run_name=<run> [prompt="ROMEO:"] [key=value ...]

The parameters come from the newest complete, readable checkpoint of
`{base_output_directory}/{run_name}/checkpoints/` (or of `load_parameters_path=`, a run folder, a
checkpoints folder or one step's folder). The model and data keys are taken from the config saved
in that checkpoint, so `run_name=` alone is enough; keys given on the command line still win.
Checkpoints are layout-independent, so generation runs on one device whatever layout trained it
(parallelism keys on the command line are ignored).

Decoding: the prompt becomes `[bos] + tokens(prompt)` (BOS with `add_bos`; at most
`max_prefill_predict_length` tokens); tokens are appended one at a time up to `max_predict_length`
tokens in all, or until EOS. The prompt is run once (prefill, padded to
`max_prefill_predict_length`: one compiled program for any prompt), filling a KV cache of
`max_predict_length` slots; each further token is one [1, 1] step against the cache (a second
compiled program). `sample_tokens(..., kv_cache=False)` keeps the loop without a cache (the
whole buffer rerun per token), the reference the cached path is tested against.
`decode_sampling_strategy`: greedy | weighted (softmax of logits / decode_sampling_temperature) |
topk (the decode_sampling_top_k largest logits, then weighted); `seed=` seeds the sampling.

stdout gets the prompt and its continuation; logs go to stderr. Exit code 2 for a config error,
found before the weights are read: no checkpoint; a prompt too long, empty without BOS, or with ids
beyond the model's vocabulary; a converted checkpoint that records no tokenizer (give
`tokenizer_path=`; a tokenizer trained on the corpus would not be the model's).
"""

from __future__ import annotations

import functools
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
from MaxText.cluster import devices, xla_flags
from MaxText.config import ALIASES, Config, ConfigError, load_config
from MaxText.config.checkpoint_keys import MODEL_KEYS, require_tokenizer
from MaxText.model import Decoder, family_of, init_cache

log = logging.getLogger("MaxText")

# Keys read from the checkpoint's saved config: the model's shape and what builds its tokenizer.
SAVED_KEYS = (
    "model_name",
    *MODEL_KEYS,
    "weight_dtype",
    "max_target_length",
    "dataset_type",
    "dataset_path",
    "dataset_name",
    "train_split",
    "eval_split",
    "tokenizer_path",
    "tokenizer_type",
    "add_bos",
    "add_eos",
    "packing",
    "grain_train_files",
    "grain_eval_files",
    "eval_split_fraction",
    "chat_template",
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
    "scan_layers": False,  # the KV-cache decode path runs unrolled layers
    "remat_policy": "none",
    "pipeline_stage_remat": "",
}
_IGNORED = {*ONE_DEVICE, "pipeline_parallelism"}


def _token(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    if isinstance(value, list | tuple):  # a list key: YAML's flow sequence
        return f"{key}=[{', '.join(str(x) for x in value)}]"
    return f"{key}={value}"


def generation_config(argv: Sequence[str]) -> tuple[Config, str]:
    """The config to sample with (model keys from the checkpoint) and the checkpoint path."""
    cli = load_config(argv)
    source = cli.load_parameters_path or cli.output_dir
    step, saved = checkpointing.saved_config(source)
    user = [t for t in argv[1:] if t.split("=", 1)[0].strip() not in _IGNORED]
    given = {ALIASES.get(k, k) for k in (t.split("=", 1)[0].strip() for t in user)}
    from_checkpoint = [_token(k, saved[k]) for k in SAVED_KEYS if k in saved and k not in given]
    forced = [_token(k, v) for k, v in ONE_DEVICE.items()]
    config = load_config([argv[0], *from_checkpoint, *user, *forced])
    del step
    return config, source


def make_sampler(config: Config, vocab_limit: int, banned: Sequence[int]):
    """(logits_V, key) -> the sampled token id (int32), by `decode_sampling_strategy`."""
    strategy = config.decode_sampling_strategy
    temperature = config.decode_sampling_temperature  # > 0 (the key's bound)
    mask_V = np.zeros((config.vocab_size,), np.float32)
    mask_V[vocab_limit:] = -np.inf  # ids the tokenizer cannot decode (a padded model vocab)
    for i in banned:
        if 0 <= i < config.vocab_size:
            mask_V[i] = -np.inf

    def sample(logits_V, key):
        logits_V = logits_V + mask_V
        if strategy == "greedy":
            return jnp.argmax(logits_V).astype(jnp.int32)
        if strategy == "topk":
            k = min(config.decode_sampling_top_k, config.vocab_size)
            top, ids = jax.lax.top_k(logits_V, k)
            return ids[jax.random.categorical(key, top / temperature)].astype(jnp.int32)
        return jax.random.categorical(key, logits_V / temperature).astype(jnp.int32)

    return sample


@functools.lru_cache(maxsize=8)
def decoding_programs(config: Config, vocab_limit: int, banned: tuple[int, ...]):
    """The jitted programs of `sample_tokens` for one config (built once, so repeated calls
    reuse their compilations): `full_step` (no cache), `prefill` and `decode` (KV cache)."""
    model = Decoder(config)
    sample = make_sampler(config, vocab_limit, banned)
    length = config.max_predict_length

    @jax.jit
    def full_step(params, tokens_1xT, t, key):
        logits_1xTxV = model.apply({"params": params}, tokens_1xT)
        return sample(jax.lax.dynamic_index_in_dim(logits_1xTxV[0], t - 1, 0, False), key)

    @jax.jit
    def prefill(params, tokens_1xP, t, key):
        positions_1xP = jnp.arange(tokens_1xP.shape[1])[None]
        cache = init_cache(config, 1, length)
        logits_1xPxV, cache = model.apply(
            {"params": params}, tokens_1xP, positions_1xP, cache=cache
        )
        return sample(jax.lax.dynamic_index_in_dim(logits_1xPxV[0], t - 1, 0, False), key), cache

    @functools.partial(jax.jit, donate_argnums=(1,))
    def decode(params, cache, token, t, key):
        positions_1x1 = jnp.reshape(t, (1, 1))
        logits_1x1xV, cache = model.apply(
            {"params": params}, jnp.reshape(token, (1, 1)), positions_1x1, cache=cache
        )
        return sample(logits_1x1xV[0, 0], key), cache

    return full_step, prefill, decode


def sample_tokens(
    config: Config,
    params: Any,
    prompt_ids: Sequence[int],
    *,
    vocab_limit: int,
    banned: Sequence[int] = (),
    eos_id: int = -1,
    kv_cache: bool = True,
    eos_ids: Sequence[int] = (),
) -> list[int]:
    """The ids generated after `prompt_ids`, up to `max_predict_length` tokens in all or EOS.

    `kv_cache=True`: the prompt (padded to `max_prefill_predict_length`) is run once, filling
    a KV cache of `max_predict_length` slots; each new token is then one [1, 1] step against
    it. `kv_cache=False`: every token reruns the model on the whole [1, max_predict_length]
    buffer (the reference loop; attention is causal, so the unused tail does not change the
    logits at the current position). Both sample token t with `fold_in(key(seed), t)`."""
    full_step, prefill, decode = decoding_programs(config, vocab_limit, tuple(banned))
    stop = {int(eos_id), *(int(i) for i in eos_ids)} - {-1}  # any of them ends the reply
    key = jax.random.key(config.seed)
    length = config.max_predict_length
    t = len(prompt_ids)
    out: list[int] = []
    if not kv_cache:
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :t] = prompt_ids
        while t < length:
            token = int(full_step(params, tokens, t, jax.random.fold_in(key, t)))
            if token in stop:
                break
            tokens[0, t] = token
            out.append(token)
            t += 1
        return out

    prompt = np.zeros((1, config.max_prefill_predict_length), np.int32)
    prompt[0, :t] = prompt_ids
    token, cache = prefill(params, prompt, t, jax.random.fold_in(key, t))
    while t < length:
        token = int(token)
        if token in stop:
            break
        out.append(token)
        t += 1
        if t < length:
            token, cache = decode(params, cache, token, t - 1, jax.random.fold_in(key, t))
    return out


def encode_prompt(config: Config, tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's ids (`[bos] + tokens`), refused in one line when there is nothing to continue
    (an empty prompt without BOS would sample from padding), when an id is beyond the model's
    vocabulary (a tokenizer that is not the model's), or when it or the output is too long."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 and config.add_bos else []
    prompt_ids = bos + list(tokenizer.encode(prompt))
    if not prompt_ids:
        why = "add_bos=false" if not config.add_bos else "the tokenizer has no BOS id"
        raise ConfigError(
            f"the prompt is empty and {why}: there is nothing to continue; give prompt=<text>"
            + (" or add_bos=true" if not config.add_bos else "")
        )
    beyond = sorted({i for i in prompt_ids if not 0 <= i < config.vocab_size})
    if beyond:
        raise ConfigError(
            f"the prompt has token ids {beyond[:3]} >= vocab_size={config.vocab_size}: the "
            f"tokenizer ({tokenizer.vocab_size} ids) is not this model's; give the model's own "
            f"tokenizer_path="
        )
    if len(prompt_ids) > config.max_prefill_predict_length:
        raise ConfigError(
            f"the prompt is {len(prompt_ids)} tokens but max_prefill_predict_length="
            f"{config.max_prefill_predict_length}; shorten it or raise max_prefill_predict_length"
        )
    length = config.max_predict_length
    if not family_of(config).rope and length > config.max_target_length:
        raise ConfigError(
            f"max_predict_length={length} exceeds the {config.max_target_length} learned positions "
            f"of decoder_block=gpt; use max_predict_length <= {config.max_target_length}"
        )
    return prompt_ids


def generate(
    config: Config, params: Any, tokenizer: Any, prompt: str, kv_cache: bool = True
) -> str:
    """The prompt followed by its sampled continuation, as text."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 and config.add_bos else []
    prompt_ids = encode_prompt(config, tokenizer, prompt)
    banned = [i for i in (tokenizer.pad_id, tokenizer.bos_id) if i >= 0]
    new = sample_tokens(
        config,
        params,
        prompt_ids,
        vocab_limit=min(tokenizer.vocab_size, config.vocab_size),
        banned=banned,
        eos_id=tokenizer.eos_id,
        kv_cache=kv_cache,
    )
    return tokenizer.decode([int(i) for i in [*prompt_ids[len(bos) :], *new]])


def chat_reply(config: Config, params: Any, tokenizer: Any, kv_cache: bool = True) -> str:
    """The assistant's reply to `chat_prompt_file`'s messages, rendered with the checkpoint's
    chat template and its generation prompt (`MaxText/data/chat_template.py`); sampling stops at
    any `eos_token_id` of the checkpoint's generation_config.json (or the tokenizer's EOS)."""
    from MaxText.data import chat_files

    folder = chat_files.tokenizer_folder(config)
    messages = chat_files.read_prompt_messages(config.chat_prompt_file)
    template = chat_files.run_template(config, folder, tokenizer)
    text = template.render(messages, add_generation_prompt=True)
    prompt_ids = list(tokenizer.encode(text))
    if len(prompt_ids) > config.max_prefill_predict_length:
        raise ConfigError(
            f"the rendered chat prompt is {len(prompt_ids)} tokens but max_prefill_predict_length="
            f"{config.max_prefill_predict_length}; shorten it or raise max_prefill_predict_length"
        )
    eos_ids = chat_files.generation_eos_ids(folder)
    banned = [i for i in (tokenizer.pad_id, tokenizer.bos_id) if i >= 0 and i not in eos_ids]
    new = sample_tokens(
        config,
        params,
        prompt_ids,
        vocab_limit=min(tokenizer.vocab_size, config.vocab_size),
        banned=banned,
        eos_id=tokenizer.eos_id,
        eos_ids=eos_ids,
        kv_cache=kv_cache,
    )
    return tokenizer.decode([int(i) for i in new])


def abstract_params(config: Config) -> Any:
    model = Decoder(config)
    tokens = jnp.zeros((1, config.max_target_length), jnp.int32)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))
    return nn.unbox(boxed)["params"]


def main(argv: Sequence[str]) -> int:
    """Entry point; returns the exit code (`MaxText/exit_codes.py`)."""
    from MaxText.config import tool_help

    if (words := tool_help.requested(argv)) is not None:  # --help [WORD]: usage and keys
        return tool_help.show("MaxText.generate", words)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    return exit_codes.run(lambda: _generate(argv))


def _generate(argv: Sequence[str]) -> int:
    try:
        config, source = generation_config(argv)
        require_tokenizer(config, source)  # a converted model that records none: refused
        if config.tokenizer_path:  # a tokenizer file (e.g. a converted Hugging Face model's)
            from MaxText.data.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(config.tokenizer_path, config.tokenizer_type)
        else:  # the one the run trained on its corpus, or its grain shards'
            from MaxText.data import make_data

            tokenizer = make_data(config).tokenizer
        encode_prompt(config, tokenizer, config.prompt)  # refused before any device starts
        xla_flags.apply_gpu_defaults(config.hardware)  # before the backend starts
        config, _ = devices.start(config)
        params, restored = checkpointing.load_params(source, abstract_params(config), config)
        params = jax.device_put(params, jax.devices()[0])
        if config.use_chat_template:
            text = chat_reply(config, params, tokenizer)
        else:
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
