"""docs/fine_tuning.md's chat fine-tuning walkthrough, run as written (one bash process, the
default grain_worker_count and checkpointing): convert -> prepare chat data -> SFT at
pipeline_parallelism=4 -> a chat reply -> export -> prepare pairs -> DPO at
pipeline_parallelism=4."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
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


@pytest.mark.slow
def test_fine_tuning_walkthrough_runs_as_written(tmp_path):
    from chat_fixtures import byte_level_tokenizer, tokenizer_folder
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
    (tmp_path / "chats.jsonl").write_text(
        "".join(json.dumps({"messages": c}) + "\n" for c in chats)
    )
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    question = [SYSTEM, {"role": "user", "content": "What is 1 plus 2?"}]
    (tmp_path / "prompt.json").write_text(json.dumps(question))
    env = dict(os.environ)
    names = ("CKPT", "DATA", "RUNS", "EXPORT", "PREFS")
    env.update({n: str(tmp_path / n.lower()) for n in names})
    env.update(
        HF=str(hf),
        CHATS=str(tmp_path / "chats.jsonl"),
        PAIRS=str(tmp_path / "pairs.jsonl"),
        PROMPT=str(tmp_path / "prompt.json"),
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
    )
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", walkthrough_commands()],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = tmp_path / "runs"
    sft = [json.loads(x) for x in (runs / "sft" / "metrics.jsonl").read_text().splitlines()]
    # records every log_period=10 steps; held-out assistant-token loss from ln(vocab) = 5.8 at
    # the start to below 1.0 (the bound of tests/test_sft.py's 40-step run, reasoned there)
    assert [r["step"] for r in sft] == [10, 20, 30] and sft[-1]["eval_loss"] < 1.0, sft[-1]
    assert all(r["trained_tokens"] == r["total_weights"] > 0 for r in sft)
    # generate prints the reply alone on a line (prepare's summary lines come before it)
    assert any(line.startswith("The answer is") for line in proc.stdout.splitlines()), proc.stdout
    exported = tmp_path / "export"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (exported / name).is_file(), name
    assert (exported / "chat_template.jinja").read_text() == fallback_source("chatml")
    dpo = [json.loads(x) for x in (runs / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in dpo] == [10]  # step 1's log 2: tests/test_dpo.py
    assert math.isfinite(dpo[-1]["loss"]) and 0.0 <= dpo[-1]["dpo_reward_accuracy"] <= 1.0
    log = proc.stdout + proc.stderr
    assert "rewards chosen " in log and " accuracy " in log
    assert "new run dpo starts from the parameters of checkpoint step 30" in proc.stderr
