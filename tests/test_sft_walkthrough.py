"""docs/fine_tuning.md's chat fine-tuning walkthrough, run as written (the default
grain_worker_count and checkpointing): convert -> prepare chat data -> SFT at
pipeline_parallelism=4 -> a chat reply -> export -> prepare pairs -> DPO at
pipeline_parallelism=4; then the SFT run, restarted from its step-20 checkpoint, repeats step 30
bit for bit (the pp=4 resume check of issue 33).

The commands run in this process: each line of the docs' bash block (comments dropped, `\\`
continuations joined, split as bash splits words, `$VARS` expanded) is handed to the `main(argv)`
of the module it names (`python train.py` is `MaxText.train`), so the block runs as written
without paying a Python and JAX start-up per command. The restart of the SFT command runs the
trainer its first run built (`build_trainer` remembered per run and config: the same compiled
programs a restarted process compiles again or reads from the session's compilation cache); it
restores its state and data position from the checkpoint as any restart does."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
from chat_world import SYSTEM, conversation
from test_dpo import pair

from MaxText.data.chat_template import fallback_source

REPO = Path(__file__).resolve().parent.parent


def walkthrough_commands() -> str:
    text = (REPO / "docs" / "fine_tuning.md").read_text()
    section = text.split("## Chat fine-tuning (SFT) and preference tuning (DPO)", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def parsed_commands(block: str, env: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(module, argv) of each command of a bash block of `python train.py ...` and
    `python -m <module> ...` lines, words split and variables expanded as bash does for these
    lines (no word of theirs holds a space or a glob bash would expand; an unset variable is a
    KeyError)."""
    lines = [x for x in block.splitlines() if x.strip() and not x.lstrip().startswith("#")]
    out = []
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        variable = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
        words = [variable.sub(lambda m: env[m.group(1)], w) for w in shlex.split(line)]
        assert words[0] == "python", line
        if words[1] == "train.py":
            out.append(("MaxText.train", words[2:]))
        else:
            assert words[1] == "-m", line
            out.append((words[2], words[3:]))
    return out


def run_command(module: str, argv: list[str]) -> int:
    return importlib.import_module(module).main(list(argv))


def remember_trainers(monkeypatch) -> None:
    """train.py's `build_trainer` returns the trainer built earlier in this test for the same
    run and the same config (the restart), else builds one (the same programs a restarted
    process would compile, or read from the compilation cache: what they compute is the same)."""
    from MaxText import train

    build, built = train.build_trainer, {}

    def remembered(config, mesh, *args, **kwargs):
        previous = built.get(config.run_name)
        if previous is not None and previous.config == config and not args and not kwargs:
            return previous
        built[config.run_name] = trainer = build(config, mesh, *args, **kwargs)
        return trainer

    monkeypatch.setattr(train, "build_trainer", remembered)


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_fine_tuning_walkthrough_runs_as_written(tmp_path, capsys, monkeypatch):
    from chat_fixtures import SPECIAL, byte_level_tokenizer, tokenizer_folder
    from hf_reference import llama_config, random_tensors, write_hf_folder

    rng = np.random.default_rng(2)
    chats = [conversation(rng) for _ in range(64)]
    pairs = [pair(rng) for _ in range(32)]
    texts = [m["content"] for c in chats for m in c] + ["system user assistant"]
    tok = byte_level_tokenizer(tmp_path / "tok.json", 320, corpus=[" ".join(texts)] * 3)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok)).get_vocab_size()
    cfg = llama_config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4)
    hf = write_hf_folder(tmp_path / "hf", cfg, random_tensors(cfg, seed=7))
    tokenizer_folder(hf, tok, "chatml", None)
    (hf / "chat_template.jinja").write_text(fallback_source("chatml"))
    # the reply must stop at <|im_end|>, an eos id that only generation_config.json names (the
    # tokenizer's own eos_token is another)
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<|end_of_text|>"}))
    stop = [SPECIAL.index("<|end_of_text|>"), SPECIAL.index("<|im_end|>")]
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    (tmp_path / "chats.jsonl").write_text(
        "".join(json.dumps({"messages": c}) + "\n" for c in chats)
    )
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    question = [SYSTEM, {"role": "user", "content": "What is 1 plus 2?"}]
    (tmp_path / "prompt.json").write_text(json.dumps(question))
    names = ("CKPT", "DATA", "RUNS", "EXPORT", "PREFS")
    env = {n: str(tmp_path / n.lower()) for n in names}
    env.update(
        HF=str(hf),
        CHATS=str(tmp_path / "chats.jsonl"),
        PAIRS=str(tmp_path / "pairs.jsonl"),
        PROMPT=str(tmp_path / "prompt.json"),
    )
    commands = parsed_commands(walkthrough_commands(), env)
    assert [m for m, _ in commands] == [
        "MaxText.to_maxtext",
        "MaxText.data.prepare",
        "MaxText.train",
        "MaxText.generate",
        "MaxText.to_huggingface",
        "MaxText.data.prepare",
        "MaxText.train",
    ]
    remember_trainers(monkeypatch)
    cwd = os.getcwd()
    os.chdir(REPO)  # the commands name configs/base.yml relative to the repository
    try:
        out, err = [], []
        for module, argv in commands:
            assert run_command(module, argv) == 0, (module, capsys.readouterr().err[-3000:])
            captured = capsys.readouterr()
            out.append(captured.out)
            err.append(captured.err)
        stdout, stderr = "".join(out), "".join(err)

        runs = tmp_path / "runs"
        sft = records(runs / "sft" / "metrics.jsonl")
        # records every log_period=10 steps; held-out assistant-token loss below 1.0 nats:
        # ln(vocab) = 5.8 for a model that knows nothing, and ~8 trained tokens per answer of
        # which only the sum is not fixed by the format (a model that learned the format and
        # guessed the sum uniformly among the 13 possible would score ln(13) / 8 = 0.32)
        assert [r["step"] for r in sft] == [10, 20, 30] and sft[-1]["eval_loss"] < 1.0, sft[-1]
        assert all(r["trained_tokens"] == r["total_weights"] > 0 for r in sft)
        # generate prints the reply alone: in the format, and stopped at <|im_end|> (without
        # that stop the model goes on after it: "The answer is 3. 6. 6. ...")
        reply = out[3].strip()
        assert re.fullmatch(r"The answer is \d+\.", reply), reply
        exported = tmp_path / "export"
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            assert (exported / name).is_file(), name
        assert (exported / "chat_template.jinja").read_text() == fallback_source("chatml")
        dpo = records(runs / "dpo" / "metrics.jsonl")
        assert [r["step"] for r in dpo] == [10]  # step 1's log 2: tests/test_dpo.py
        assert math.isfinite(dpo[-1]["loss"]) and 0.0 <= dpo[-1]["dpo_reward_accuracy"] <= 1.0
        log = stdout + stderr  # the step lines go to stdout (through the progress bar)
        assert "rewards chosen " in log and " accuracy " in log
        assert "new run dpo starts from the parameters of checkpoint step 30" in stderr

        # Resume at pipeline_parallelism=4: the SFT command again, its step-30 checkpoint moved
        # away, so that it restores step 20's (checkpoint_period=10): state and data position
        # mid-way through an epoch (asserted below). Step 30's record (loss after ten more
        # updates, and the evaluation of the parameters they made) repeats bit for bit.
        checkpoints = runs / "sft" / "checkpoints"
        assert sorted(int(p.name) for p in checkpoints.iterdir()) == [10, 20, 30]
        shutil.move(checkpoints / "30", tmp_path / "sft_step_30")
        module, argv = commands[2]
        assert run_command(module, argv) == 0, capsys.readouterr().err[-3000:]
        assert "resuming run sft from checkpoint step 20" in capsys.readouterr().err
    finally:
        os.chdir(cwd)
    again = records(runs / "sft" / "metrics.jsonl")[len(sft) :]
    assert [r["step"] for r in again] == [30]
    for key in ("loss", "eval_loss", "trained_tokens", "grad_norm"):  # JSON floats: all bits
        assert again[0][key] == sft[-1][key], (key, again[0][key], sft[-1][key])
    assert_mid_epoch(argv, steps=20)


def assert_mid_epoch(argv: list[str], steps: int):
    """The first `steps` batches of the run's data hold a number of examples (packed segments)
    that is not a multiple of the train split's (its manifest's count): the checkpoint after
    them is inside an epoch, not at its end."""
    from MaxText.config import load_config
    from MaxText.data import make_data

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        data = make_data(load_config([*argv, "grain_worker_count=0"]))  # the same rows
    finally:
        os.chdir(cwd)
    try:
        seen = 0
        for _ in range(steps):
            segments = next(data.train)["inputs_segmentation"]
            seen += sum(len(set(row.tolist()) - {0}) for row in segments)
    finally:
        data.close()
    train_files = next(a.split("=", 1)[1] for a in argv if a.startswith("grain_train_files="))
    manifest = json.loads((Path(train_files).parent / "manifest.json").read_text())
    split = manifest["splits"]["train"]["documents"]
    assert seen % split != 0, (seen, split)
