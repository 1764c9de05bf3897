"""The `tiny-moe` preset end to end through the command-line entry points (issue 32's "done
when"): `train.py configs/base.yml model_name=tiny-moe pipeline_parallelism=2
ici_expert_parallelism=2` trains with the default keys (bundled Shakespeare, scanned layers, 1F1B,
gradient_reduction auto, checkpoints, evaluation at the end), its checkpoint resumes at
pipeline_parallelism=1 x ici_expert_parallelism=4 and at 4 x 1, exports to Hugging Face's
MixtralForCausalLM and back bit for bit, and generates text.

Resumed runs are compared with the uninterrupted one at the step after the checkpoint: the state
is restored bitwise (checkpoints are layout-free), so step 2 runs from the same state in another
layout and differs only in the order of its float32 sums (other splits of the batch over devices,
other microbatch sums' placement). Its loss, load-balancing loss and gradient norm are sums over
the step's 1,024 tokens (global batch 16 x 64), the norm over squares of such sums: within
`reordered_sum_rtol(1024)` of their value (tests/compare.py).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from compare import reordered_sum_rtol

from MaxText.config import CONFIGS_DIR
from MaxText.generate import main as generate
from MaxText.to_huggingface import main as to_huggingface
from MaxText.to_maxtext import main as to_maxtext
from MaxText.train import main as train

BASE = str(CONFIGS_DIR / "base.yml")
# 16 rows of 64 tokens: 1,024 tokens a step, in 4 microbatches of 4 rows in every layout (the
# default at pp=2 is 2 x stages = 4; the resumed layouts set it, since the load-balancing loss, a
# product of means per microbatch, depends on the microbatching: docs/moe.md)
PRESET = ["model_name=tiny-moe", "global_batch_size=16", "max_target_length=64"]
SAME_MICROBATCHES = "num_pipeline_microbatches=4"
RUN = ["steps=2", "log_period=1", "checkpoint_period=1", "eval_steps=1",
       "learning_rate_schedule_steps=2", "enable_progress_bar=false",
       "enable_tensorboard=false"]  # fmt: skip


def losses(run_dir) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record
    return out


def _forbid_initialisation(monkeypatch):
    """From now on a trainer's `init_state()` raises: a resumed run must take its state from
    the checkpoint alone, never compiling or running the random initialisation (a pipelined
    trainer compiles its step on abstract inputs)."""
    from MaxText import train_step

    real = train_step._init_on

    def guarded(*args, **kwargs):
        _, shardings = real(*args, **kwargs)

        def init_state():
            raise AssertionError("a resumed run initialised a fresh state")

        return init_state, shardings

    monkeypatch.setattr(train_step, "_init_on", guarded)


@pytest.mark.slow
def test_tiny_moe_trains_resumes_converts_and_generates(tmp_path, capsys, monkeypatch):
    layout = ["pipeline_parallelism=2", "ici_expert_parallelism=2"]
    argv = [BASE, *PRESET, *RUN, f"base_output_directory={tmp_path}"]
    assert train([*argv, *layout, "run_name=full"]) == 0
    full = losses(tmp_path / "full")
    assert sorted(full) == [1, 2] and "eval_loss" in full[2]
    assert full[2]["moe_lb_loss"] > 0 and full[2]["moe_tokens_per_expert_max"] > 0
    capsys.readouterr()

    _forbid_initialisation(monkeypatch)  # the resumed runs: SPMD and pipelined
    for name, other in (("pp1_ep4", ["ici_expert_parallelism=4", SAME_MICROBATCHES]),
                        ("pp4_ep1", ["pipeline_parallelism=4", SAME_MICROBATCHES])):  # fmt: skip
        shutil.copytree(tmp_path / "full" / "checkpoints" / "1",
                        tmp_path / name / "checkpoints" / "1")  # fmt: skip
        assert train([*argv, *other, f"run_name={name}", "eval_interval=0"]) == 0
        resumed = losses(tmp_path / name)
        assert sorted(resumed) == [2], name  # resumed from step 1
        for key in ("loss", "moe_lb_loss", "grad_norm"):
            np.testing.assert_allclose(resumed[2][key], full[2][key], err_msg=f"{name} {key}",
                                       rtol=reordered_sum_rtol(16 * 64))  # fmt: skip

    monkeypatch.undo()
    hf = tmp_path / "hf"
    assert to_huggingface([BASE, f"base_output_directory={tmp_path}", "run_name=full",
                           f"hf_output_path={hf}"]) == 0  # fmt: skip
    config_json = json.loads((hf / "config.json").read_text())
    assert config_json["architectures"] == ["MixtralForCausalLM"]
    assert config_json["num_local_experts"] == 8
    back = tmp_path / "back"
    assert to_maxtext([BASE, f"hf_model_path={hf}", f"base_output_directory={back}"]) == 0
    again = tmp_path / "hf_again"
    assert to_huggingface([BASE, f"load_parameters_path={back}", f"hf_output_path={again}"]) == 0
    first, second = ((d / "model.safetensors").read_bytes() for d in (hf, again))
    assert first == second  # every tensor (each expert's) bit for bit, same file

    capsys.readouterr()
    assert generate([BASE, f"base_output_directory={tmp_path}", "run_name=full",
                     "max_prefill_predict_length=8", "max_predict_length=24"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and len(out.strip()) > len("ROMEO:")
