"""The training loop: `main(argv)` builds everything from the config and trains `steps` steps.

    python train.py configs/base.yml [key=value ...]      (or: python -m MaxText.train ...)

Order: config -> devices (emulated CPU devices if needed) -> mesh -> data -> model + compiled steps
-> state (fresh, or restored: `MaxText/checkpoint/manager.py`) -> loop -> metrics / checkpoints.

The loop dispatches step N+1 before reading step N's metrics back, so the host prepares the next
batch while the devices work; step time is the interval between consecutive step completions.
Every step prints MaxText's line `completed step: N, seconds: S, TFLOP/s/device: T,
Tokens/s/device: K, total_weights: W, loss: L`. Every `log_period` steps (and at evaluations and
the last step) it logs a richer line and a metrics.jsonl record; every `eval_interval` steps and
at the end it evaluates on the held-out split; a NaN or infinite loss aborts with the step number
(exit code 1). Config and data-setting errors exit with code 2 and one line.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import jaxpp_integration as jaxpp
from MaxText import memory, sharding
from MaxText.checkpoint.manager import Checkpoints
from MaxText.cluster import devices, gpu_host, xla_flags
from MaxText.config import Config, load_config
from MaxText.errors import UserError
from MaxText.metrics import MetricsLogger, setup_logging
from MaxText.model import count_params
from MaxText.planning import flops
from MaxText.profiling import Profiler
from MaxText.train_step import Trainer, build_trainer, evaluate, measured_train_step

log = logging.getLogger("MaxText")


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite."""


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    # fetch: under several processes the metrics live on the last pipeline group's process and
    # are broadcast, so every process logs and checks for NaN alike
    return {k: float(v) for k, v in jaxpp.fetch(metrics).items()}


def run(config: Config, trainer: Trainer, data: Any) -> dict[str, Any]:
    """Trains from the restored/initial state to `config.steps`; returns the last record."""
    platform = jax.devices()[0].platform
    peak = flops.peak_tflops(config, platform, jax.devices()[0].device_kind)
    step_flops = flops.training_flops_per_step(config)
    tflops_per_device = step_flops.total / config.num_devices / 1e12

    checkpoints = Checkpoints(config, trainer)
    try:
        state = checkpoints.restore_or_init(data)
    except BaseException:
        checkpoints.close()
        raise
    start = int(np.asarray(state["step"]))
    logger = MetricsLogger(config, mfu_estimate=peak.estimate, start_step=start)
    info = getattr(data, "info", None)
    if info is not None:
        logger.info(info.summary())
    logger.info(
        f"model: {config.model_name} ({config.decoder_block}), "
        f"{count_params(state['params']):,} parameters; "
        f"{step_flops.total / 1e12:.3f} TFLOP per step "
        f"({100 * step_flops.weights / step_flops.total:.0f}% weights, "
        f"{100 * step_flops.attention / step_flops.total:.0f}% attention); "
        f"peak {peak.tflops:.3f} TFLOP/s/device ({peak.source})"
    )
    logger.info(
        f"mesh {dict(trainer.mesh.shape)}; {config.num_pipeline_microbatches} microbatches of "
        f"{config.microbatch_size} x {config.max_target_length} tokens"
        + (
            f"; schedule {config.pipeline_schedule}, stages of {list(config.stage_layers)} layers"
            if config.is_pipelined
            else ""
        )
        + f"; step compiled in {trainer.compile_seconds:.1f} s"
    )
    stats = getattr(trainer.train_step, "compile_stats", None)
    if stats is not None:  # pipelined: each process compiles only its own groups' programs
        logger.info(
            f"process {jax.process_index()}: task programs of groups "
            f"{sorted(trainer.train_step.local_ranks)} compiled here: {stats.compiles} XLA "
            f"compiles, {stats.loads} loaded onto another group"
        )
    local = [d for d in trainer.mesh.devices.flat if d.process_index == jax.process_index()]
    memory.log_memory(logger.info, trainer.train_step, local)
    if start >= config.steps:
        logger.info(f"run {config.run_name} is already at step {start} >= steps={config.steps}")
        logger.close()
        checkpoints.close()
        return {}

    train_iter = iter(data.train)
    window: list[float] = []
    last: dict[str, Any] = {}
    pending: tuple[int, dict[str, Any]] | None = None
    measured_peaks: list | None = None  # written into the first logged record
    t_done = time.perf_counter()
    profiler = Profiler(config, start, logger.info)

    def finish(step: int, metrics: dict[str, Any], evaluate_now: bool) -> None:
        nonlocal t_done, last, measured_peaks
        values = _scalars(metrics)  # blocks until `step` has finished
        now = time.perf_counter()
        seconds = now - t_done
        window.append(seconds)
        t_done = now
        if not math.isfinite(values["loss"]):
            raise TrainingDivergedError(
                f"loss is {values['loss']} at step {step}; aborting "
                f"(try a lower learning_rate or a gradient_clipping_threshold)"
            )
        logger.advance(step, values["loss"])
        logger.step_line(
            step,
            seconds,
            tflops_per_device / seconds,
            config.tokens_per_step / seconds / config.num_devices,
            values["tokens"],
            values["loss"],
        )
        record: dict[str, Any] = {}
        if evaluate_now:
            eval_loss, n = evaluate(
                trainer, state["params"], data.eval_batches(), config.eval_steps
            )
            record.update(eval_loss=eval_loss, eval_batches=n)
            t_done = time.perf_counter()  # do not charge evaluation to the next step
        if evaluate_now or step % config.log_period == 0 or step == config.steps:
            step_time = sum(window) / len(window)
            achieved = tflops_per_device / step_time
            record = {
                "step": step,
                "loss": values["loss"],
                "step_time_s": step_time,
                "tokens_per_s_per_device": config.tokens_per_step / step_time / config.num_devices,
                "tflops_per_s_per_device": achieved,
                "mfu": flops.mfu(achieved, peak),
                "grad_norm": values["grad_norm"],
                "raw_grad_norm": values["raw_grad_norm"],
                "learning_rate": values["learning_rate"],
                "total_weights": values["tokens"],
                "tokens": values["tokens"],
                **record,
            }
            if measured_peaks is not None:
                record["peak_bytes_per_group"] = measured_peaks
                measured_peaks = None
            logger.write(record)
            window.clear()
            last = record

    try:
        for step in range(start + 1, config.steps + 1):
            batch = trainer.put_batch(next(train_iter))
            step_kwargs = profiler.step_kwargs(step)  # starts the trace; the engine's timing
            if step == start + 1:  # peak bytes per group, measured once (a slower step)
                state, metrics, measured_peaks = measured_train_step(
                    trainer, state, batch, **step_kwargs
                )
            else:
                state, metrics = trainer.train_step(state, batch, **step_kwargs)
            if pending is not None:
                finish(*pending, evaluate_now=False)
                pending = None
            # stopping the trace (and drawing the timeline) is not charged to this step
            t_done += profiler.after_step(step, (state, metrics), trainer.train_step)
            evaluate_now = config.eval_interval > 0 and (
                step % config.eval_interval == 0 or step == config.steps
            )
            if evaluate_now or config.is_pipelined:
                # the pipelined step runs its tasks while it dispatches them (small CPU programs
                # even synchronously), so read it back now: otherwise step N's time would hold
                # step N+1's work
                finish(step, metrics, evaluate_now=evaluate_now)
            else:
                pending = (step, metrics)
            checkpoints.maybe_save(step, state, data, final=step == config.steps)
        if pending is not None:
            finish(*pending, evaluate_now=False)
    finally:
        profiler.close()
        logger.close()
        checkpoints.close()  # waits for an async save still being written
    return last


def main(argv: Sequence[str]) -> int:
    """Entry point; returns the process exit code (0 ok, 1 diverged, 2 config error)."""
    setup_logging()
    try:
        config = load_config(argv)
        xla_flags.apply_gpu_defaults(config.hardware)  # before the backend starts
        config, devs = devices.start(config)  # processes and -1 axes decided, devices ready
        gpu_host.check_backend(
            devs[0].platform,
            hardware=config.hardware,
            allow_cpu_fallback=config.allow_cpu_fallback,
        )
    except UserError as e:
        print(f"{e.prefix}: {e}", file=sys.stderr)
        return 2
    from MaxText.data import make_data

    try:
        data = make_data(config)  # raises ValueError for unusable data settings
    except ValueError as e:
        print(f"data error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    from MaxText.cluster.compile_cache import compilation_cache
    from MaxText.planning.auto import resolve_auto

    with compilation_cache(config.jax_cache_dir):
        try:
            config = resolve_auto(config)  # "auto" schedule, microbatches, split, remat
        except UserError as e:
            print(f"{e.prefix}: {e}", file=sys.stderr)
            return 2
        mesh = sharding.make_mesh(config, devs)
        trainer = build_trainer(config, mesh)
        try:
            last = run(config, trainer, data)
        except TrainingDivergedError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except UserError as e:  # e.g. a checkpoint of another model or seed, or unreadable
            print(f"{e.prefix}: {e}", file=sys.stderr)
            return 2
    if last:
        summary = f"done: {config.steps} steps, loss {last['loss']:.4f}"
        if "eval_loss" in last:
            summary += f", eval_loss {last['eval_loss']:.4f}"
        log.info(summary + f"; metrics in {config.metrics_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
