"""Chat fine-tuning (use_sft) end to end, from a converted Hugging Face checkpoint.

One world per module: a byte-level tokenizer.json with ChatML's special tokens, a random Llama
(4 layers, width 32) written as a Hugging Face folder with its tokenizer, `chat_template.jinja`
(ChatML, Qwen 2.5's) and a generation_config.json, converted with to_maxtext (which copies the
tokenizer files into the checkpoint), and a synthetic chat set ("What is 3 plus 4?" -> "The
answer is 7.") prepared from the converted checkpoint with `prepare --format chat`.

References nobody here wrote or that the test computes on its own:
- the trained tokens: transformers' `return_assistant_tokens_mask` on a ChatML template with
  `{% generation %}` tags that renders these conversations identically (asserted);
- the loss: a float64 numpy Llama forward pass (tests/hf_reference.py) of each packed example
  on its own (a packed row's examples attend only within themselves, positions restarting),
  cross-entropy over those tokens, mean over the global batch's trained tokens.
Tolerance 1e-5 absolute on a loss ~6: float32 logits of magnitude ~5 differ from float64 by a few
ulps (~1e-6) per token; the mean over ~100 tokens does not grow that.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from chat_world import (
    BASE,
    chat_model,
    conversation,
    independent_masks,
    segments,
    target_logprobs,
)
from small_model import merged

from MaxText.config import load_config
from MaxText.data.prepare import main as prepare
from MaxText.train import main as train

TOL = 1e-5


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    rng = np.random.default_rng(0)
    chats = [conversation(rng) for _ in range(96)]
    model = chat_model(root, [m["content"] for c in chats for m in c] + ["system user assistant"])
    ckpt = model["ckpt"][0]
    with open(root / "chats.jsonl", "w") as f:
        for c in chats:
            f.write(json.dumps({"messages": c}) + "\n")
    data = root / "data"
    args = ["--format", "chat", "--input", str(root / "chats.jsonl"), "--out", str(data)]
    args += ["--tokenizer_path", str(ckpt), "--eval_fraction", "0.15", "--quiet"]
    assert prepare(args) == 0
    return {
        "root": root,
        "cfg": model["cfg"],
        "tensors": model["tensors"][0],
        "ckpt": ckpt,
        "data": data,
        "chats": chats,
        "hf": model["hf"],
        "masks": independent_masks(model["hf"], chats),
        "logprobs": {},  # token ids -> float64 log-probabilities (reference_loss)
    }


def sft_keys(world, *extra: str) -> list[str]:
    data = world["data"]
    return merged(
        BASE,
        f"load_parameters_path={world['ckpt']}",
        "use_sft=true",
        "dataset_type=grain",
        f"grain_train_files={data}/train-*.array_record",
        f"grain_eval_files={data}/eval-*.array_record",
        "max_target_length=96",  # two examples per packed row (at 64: one, packing unseen)
        "global_batch_size=8",
        "log_period=1",
        "eval_interval=0",
        "enable_progress_bar=false",
        "enable_tensorboard=false",
        "grain_worker_count=0",  # the default (1) runs in test_fine_tuning_docs.py
        f"base_output_directory={world['root'] / 'runs'}",
        *extra,
    )


def records(world, run: str) -> list[dict]:
    path = world["root"] / "runs" / run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def reference_loss(world, batch) -> tuple[float, int]:
    """float64 loss of a batch: each example (segment) on its own, over the independently
    computed trained tokens (asserted equal to the batch's mask); (loss, trained tokens)."""
    total, count = 0.0, 0
    for r, where, ids in segments(batch):
        key = tuple(ids.tolist())
        mask = world["masks"][key][1:]  # KeyError: not one whole example
        np.testing.assert_array_equal(batch["targets_mask"][r, where], mask)
        # an example's float64 log-probabilities, computed once per module (the layouts' batches
        # hold the same examples, packed or one per row)
        if key not in world["logprobs"]:
            world["logprobs"][key] = target_logprobs(world["cfg"], world["tensors"], ids)
        total -= float((world["logprobs"][key] * mask).sum())
        count += int(mask.sum())
    return total / count, count


def first_batch(argv):
    from MaxText.data import make_data

    data = make_data(load_config(argv))
    batch = next(data.train)
    data.close()
    return batch


@pytest.mark.parametrize(
    "layout",
    [
        [],
        ["packing=false"],
        ["pipeline_parallelism=2"],
        ["pipeline_parallelism=2", "packing=false"],
    ],
    ids=["spmd", "spmd_unpacked", "pp2", "pp2_unpacked"],
)
def test_first_step_loss_equals_float64_reference(world, layout):
    """One step of train.py from the converted checkpoint, default keys otherwise (scanned
    layers; SPMD or pipelined, packed rows or one example per row): the loss is the float64
    reference's, over as many trained tokens. (Learning the format, the chat reply and resuming
    at pipeline_parallelism=4: tests/test_sft_walkthrough.py.)"""
    run = "first_" + ("_".join(layout).replace("=", "") or "spmd")
    argv = sft_keys(world, "steps=1", "enable_checkpointing=false", f"run_name={run}", *layout)
    assert train(argv) == 0
    record = records(world, run)[0]
    want, count = reference_loss(world, first_batch(argv))
    assert record["trained_tokens"] == record["total_weights"] == count
    assert abs(record["loss"] - want) <= TOL, (record["loss"], want)


def test_changing_every_prompt_target_leaves_the_loss(world):
    """The step's loss function (the SPMD eval step: the train step's loss, no update) on the
    first batch and on the batch with every target outside the assistant spans replaced (prompt
    tokens and padding): bitwise the same sums. With sft_train_on_completion_only=false (every
    token trained) the same change moves the loss, so the change reaches the loss."""
    import jax

    from MaxText.checkpoint import manager
    from MaxText.generate import abstract_params
    from MaxText.model import Decoder
    from MaxText.train_step import make_eval_step

    # One loss program for both keys: the key changes the batches' masks (what the data
    # pipeline writes), not the model or its loss function.
    config = load_config(sft_keys(world))
    params, _ = manager.load_params(world["ckpt"], abstract_params(config), config)
    step = jax.jit(make_eval_step(Decoder(config)))
    sums, prompt = {}, None
    for completion_only in ("true", "false"):
        batch = first_batch(sft_keys(world, f"sft_train_on_completion_only={completion_only}"))
        if prompt is None:  # the rows are the same with either key; the masks differ
            prompt, trained = batch["targets_mask"] == 0, batch["targets_mask"].sum()
            assert prompt.sum() > trained > 0
        changed = dict(batch)
        changed["targets"] = np.where(prompt, (batch["targets"] + 7) % 300, batch["targets"])
        sums[completion_only] = [
            {k: np.asarray(v) for k, v in step(params, b).items()} for b in (batch, changed)
        ]
    (a, b), (c, d) = sums["true"], sums["false"]
    np.testing.assert_array_equal(a["loss_sum"], b["loss_sum"])
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert abs(float(c["loss_sum"]) - float(d["loss_sum"])) > 1.0
