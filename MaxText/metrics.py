"""Where training metrics go: the console line, metrics.jsonl, TensorBoard and the progress bar.

One `MetricsLogger` per run. `step_line(...)` prints MaxText's parsable line after every step:
`completed step: 7, seconds: 0.312, TFLOP/s/device: 0.043, Tokens/s/device: 6563.103,
total_weights: 2048, loss: 5.432`. `write(record)` takes one dict per logged step and

- prints `step 10/600 | loss 5.4321 | 0.312 s/step | 6,563 tokens/s/device | 0.043 TFLOP/s/device
  | MFU 10.3% (CPU estimate) | lr 3.00e-03 | grad_norm 0.830` (plus `eval_loss` when evaluated);
- appends the record as one JSON object to `{base_output_directory}/{run_name}/metrics.jsonl`
  (keys: step, loss, step_time_s, tokens_per_s_per_device, tflops_per_s_per_device, mfu,
  grad_norm (after clipping), raw_grad_norm (before), learning_rate, total_weights (counted target
  tokens; also under its old name `tokens`), and eval_loss / eval_batches when evaluated);
- adds the scalars to TensorBoard event files under `.../tensorboard` (tensorboardX), named like
  MaxText's: learning/loss, learning/grad_norm, learning/raw_grad_norm, learning/total_weights,
  learning/current_learning_rate,
  perf/step_time_seconds, perf/per_device_tokens_per_sec, perf/per_device_tflops_per_sec, perf/mfu,
  eval/avg_loss.

The progress bar (tqdm, on stderr) advances every step; console lines are written through it so
they do not tear the bar. `setup_logging()` sends the MaxText loggers' INFO lines to the current
stderr (the trainer's and the planner's).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Any

from tqdm import tqdm

from MaxText.config import Config

TENSORBOARD_NAMES = {
    "loss": "learning/loss",
    "grad_norm": "learning/grad_norm",
    "raw_grad_norm": "learning/raw_grad_norm",
    "total_weights": "learning/total_weights",
    "learning_rate": "learning/current_learning_rate",
    "step_time_s": "perf/step_time_seconds",
    "tokens_per_s_per_device": "perf/per_device_tokens_per_sec",
    "tflops_per_s_per_device": "perf/per_device_tflops_per_sec",
    "mfu": "perf/mfu",
    "eval_loss": "eval/avg_loss",
}


def maxtext_step_line(
    step: int, seconds: float, tflops: float, tokens_per_s: float, total_weights: float, loss: float
) -> str:
    """MaxText's per-step line (the same fields, order and format), parsable by its tools."""
    weights = int(total_weights) if float(total_weights).is_integer() else total_weights
    return (
        f"completed step: {step}, seconds: {seconds:.3f}, TFLOP/s/device: {tflops:.3f}, "
        f"Tokens/s/device: {tokens_per_s:.3f}, total_weights: {weights}, loss: {loss:.3f}"
    )


def format_line(record: dict[str, Any], total_steps: int, mfu_estimate: bool) -> str:
    parts = [
        f"step {record['step']}/{total_steps}",
        f"loss {record['loss']:.4f}",
        f"{record['step_time_s']:.3f} s/step",
        f"{record['tokens_per_s_per_device']:,.0f} tokens/s/device",
        f"{record['tflops_per_s_per_device']:.3f} TFLOP/s/device",
        f"MFU {100 * record['mfu']:.1f}%" + (" (CPU estimate)" if mfu_estimate else ""),
        f"lr {record['learning_rate']:.2e}",
        f"grad_norm {record['grad_norm']:.3f}",
    ]
    if "trained_tokens" in record:  # use_sft / use_dpo: the tokens the loss counts
        parts.append(f"trained tokens {record['trained_tokens']:,.0f}")
    for key, name in (("examples_truncated", "truncated"), ("examples_dropped", "dropped")):
        if record.get(key):
            parts.append(f"{record[key]:,} examples {name}")
    if "dpo_reward_accuracy" in record:
        parts.append(
            f"rewards chosen {record['dpo_chosen_reward']:+.4f} rejected "
            f"{record['dpo_rejected_reward']:+.4f} margin {record['dpo_reward_margin']:+.4f} "
            f"accuracy {record['dpo_reward_accuracy']:.3f}"
        )
    if "eval_loss" in record:
        parts.append(f"eval_loss {record['eval_loss']:.4f}")
    return " | ".join(parts)


class MetricsLogger:
    """Writes logged steps to the console, metrics.jsonl and TensorBoard; owns the progress bar."""

    def __init__(self, config: Config, mfu_estimate: bool, start_step: int = 0):
        self.config = config
        self.mfu_estimate = mfu_estimate
        # under several processes every process computes the same records; process 0 writes them
        self._writer = config.process_id == 0
        os.makedirs(config.output_dir, exist_ok=True)
        if self._writer:
            os.makedirs(os.path.dirname(os.path.abspath(config.metrics_file)), exist_ok=True)
        self._jsonl = (
            open(config.metrics_file, "a", buffering=1)  # noqa: SIM115 (closed in close)
            if self._writer
            else None
        )
        self._tb = None
        if config.enable_tensorboard and self._writer:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(config.tensorboard_dir)
            self._tb.add_text(
                "config", "\n".join(f"    {k}: {v}" for k, v in config.to_dict().items())
            )
        self._bar = tqdm(
            total=config.steps,
            initial=start_step,
            unit="step",
            dynamic_ncols=True,
            disable=not (config.enable_progress_bar and self._writer),
            file=sys.stderr,
        )

    def info(self, line: str) -> None:
        """A console line that does not tear the progress bar."""
        if self._bar.disable:
            print(line, flush=True)
        else:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()

    def advance(self, step: int, loss: float) -> None:
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def step_line(self, *fields: Any) -> None:
        """MaxText's `completed step: ...` line (see `maxtext_step_line`), every step."""
        self.info(maxtext_step_line(*fields))

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (float(v) if isinstance(v, float) else v) for k, v in record.items()}
        self.info(format_line(clean, self.config.steps, self.mfu_estimate))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            for key, name in TENSORBOARD_NAMES.items():
                value = clean.get(key)
                if isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(name, value, clean["step"])
            self._tb.flush()

    def close(self) -> None:
        self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a line is logged (pytest and notebooks swap it;
    a handler bound to an old stream would write to a closed file)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def setup_logging() -> None:
    """INFO lines of the MaxText.* loggers to stderr, whatever imported libraries configured."""
    log = logging.getLogger("MaxText")
    if not log.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
