"""The training loop: `main(argv)` builds everything from the config and trains `steps` steps.

    python train.py configs/base.yml [key=value ...]      (or: python -m MaxText.train ...)

Order: config -> devices (emulated CPU devices if needed) -> mesh -> data -> model + compiled steps
-> state (fresh, or restored: `MaxText/checkpoint/manager.py`) -> loop -> metrics / checkpoints.

The loop dispatches step N+1 before reading step N's metrics back (pipelined or not), so the host
prepares the next batch while the devices work. It reads a step's metrics at once only where it
must: before an evaluation, before a checkpoint is saved (a NaN state is never written) and at the
last step. Step time is the interval between consecutive step ends, observed without waiting
(`MaxText/step_clock.py`); the run ends with the host's median gap between dispatches.
Every step prints MaxText's line `completed step: N, seconds: S, TFLOP/s/device: T,
Tokens/s/device: K, total_weights: W, loss: L`. Every `log_period` steps (and at evaluations and
the last step) it logs a richer line and a metrics.jsonl record; every `eval_interval` steps and
at the end it evaluates on the held-out split; a NaN or infinite loss aborts with the step number
and the newest checkpoint on disk.

`steps=0` exits 0 at once, before any device starts or anything is compiled.

Exit codes (`MaxText/exit_codes.py`): config, data and path errors exit 2 with one line, before
anything is compiled (paths: `MaxText/cluster/output_paths.py`); a NaN loss or a storage failure
during the run exits 1 with one line; SIGTERM / SIGINT save the step in flight and exit 143 / 130
(`MaxText/cluster/preemption.py`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import jaxpp_integration as jaxpp
from MaxText import exit_codes, memory, sharding
from MaxText.checkpoint.manager import Checkpoints, check_model_before_compiling
from MaxText.cluster import devices, gpu_host, xla_flags
from MaxText.cluster.output_paths import check_run_paths, os_reason
from MaxText.cluster.preemption import StoppedBeforeStart, StopRequests
from MaxText.config import Config, load_config
from MaxText.config.checkpoint_keys import require_tokenizer
from MaxText.data.doc_packing import COUNT_KEYS
from MaxText.errors import StorageError
from MaxText.metrics import MetricsLogger, setup_logging
from MaxText.model import count_params
from MaxText.planning import flops
from MaxText.profiling import Profiler
from MaxText.step_clock import StepClock
from MaxText.train_step import (
    METRIC_KEYS as STEP_METRICS,
)
from MaxText.train_step import (
    Trainer,
    build_trainer,
    evaluate,
    measured_train_step,
)

log = logging.getLogger("MaxText")


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite."""

    prefix = "error"
    exit_code = exit_codes.RUN_FAILURE


class Stopped(BaseException):  # noqa: N818 (not an error: the run stopped as asked)
    """The run saved its step and stopped after a signal; `exit_code` is 128 + its number."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """A step's metrics as read back (`jaxpp.fetch_later(...).result()`: every process gets the
    same values, so each logs and checks for NaN alike) -> floats."""
    return {k: float(v) for k, v in metrics.items()}


def _read_every(config: Config) -> int:
    """How many steps' metrics are read back together: 1 in one process (a read is local), a
    log period under several processes, where the values travel to every process in one
    collective per read (`jaxpp.fetch_later`), not one per step."""
    return 1 if jax.process_count() == 1 else max(1, config.log_period)


def run(
    config: Config, trainer: Trainer, data: Any, stops: StopRequests | None = None
) -> dict[str, Any]:
    """Trains from the restored/initial state to `config.steps`; returns the last record.

    Raises `TrainingDivergedError` on a NaN/Inf loss, `StorageError` when saving or writing
    metrics fails, and `Stopped` after saving the step reached when `stops` asks to stop.
    The steps: `_Loop`.
    """
    stops = stops or StopRequests()
    checkpoints = Checkpoints(config, trainer)
    try:
        state = checkpoints.restore_or_init(data)
        if config.use_dpo:  # the frozen reference: the parameters the run started from
            trainer.train_step.set_reference(checkpoints.starting_params())
    except BaseException:
        checkpoints.close()
        raise
    loop = _Loop(config, trainer, data, checkpoints, state)
    loop.log_start()
    if loop.start >= config.steps:
        loop.logger.info(
            f"run {config.run_name} is already at step {loop.start} >= steps={config.steps}"
        )
        loop.logger.close()
        checkpoints.close()
        return {}
    try:
        loop.train(stops)
    except BaseException:
        with stops.stop_now_deferred():  # a second Ctrl-C never cuts the data workers' stop
            loop.close(after_error=True)
        raise
    with stops.stop_now_deferred():
        loop.close()
    return loop.last


class _Loop:
    """One run of the training loop: the state, the logger and the per-step bookkeeping that
    `train` (dispatch), `finish` (read a step's metrics) and `record` (log them) share."""

    def __init__(self, config, trainer, data, checkpoints, state):
        self.config, self.trainer, self.data, self.checkpoints = config, trainer, data, checkpoints
        self.state = state
        self.start = int(np.asarray(state["step"]))
        device = jax.devices()[0]
        self.peak = flops.peak_tflops(config, device.platform, device.device_kind)
        self.step_flops = flops.training_flops_per_step(config)
        self.tflops_per_device = self.step_flops.total / config.num_devices / 1e12
        self.logger = MetricsLogger(config, mfu_estimate=self.peak.estimate, start_step=self.start)
        self.window: list[float] = []  # step times since the last record
        self.last: dict[str, Any] = {}
        self.measured_peaks: list | None = None  # written into the first logged record
        self.profiler: Profiler | None = None
        self.clock = StepClock()
        self.example_counts: dict[str, int] = {}  # chat data: examples truncated / dropped

    def log_start(self) -> None:
        """The run's opening lines: data, model, mesh and compile, memory."""
        config, trainer, info = self.config, self.trainer, self.logger.info
        data_info = getattr(self.data, "info", None)
        if data_info is not None:
            info(data_info.summary())
        step_flops = self.step_flops
        info(
            f"model: {model_description(config)}, "
            f"{count_params(self.state['params']):,} parameters; "
            f"{step_flops.total / 1e12:.3f} TFLOP per step "
            f"({100 * step_flops.weights / step_flops.total:.0f}% weights, "
            f"{100 * step_flops.attention / step_flops.total:.0f}% attention); "
            f"peak {self.peak.tflops:.3f} TFLOP/s/device ({self.peak.source})"
        )
        pipeline = (
            f"; schedule {config.pipeline_schedule}, stages of {list(config.stage_layers)} layers"
            if config.is_pipelined
            else ""
        )
        info(
            f"mesh {dict(trainer.mesh.shape)}; {config.num_pipeline_microbatches} microbatches of "
            f"{config.microbatch_size} x {config.max_target_length} tokens{pipeline}"
            f"; step compiled in {trainer.compile_seconds:.1f} s"
        )
        stats = getattr(trainer.train_step, "compile_stats", None)
        if stats is not None:  # pipelined: each process compiles only its own groups' programs
            info(
                f"process {jax.process_index()}: task programs of groups "
                f"{sorted(trainer.train_step.local_ranks)} compiled here: {stats.compiles} XLA "
                f"compiles, {stats.persistent_hits} read from jax_cache_dir, {stats.loads} loaded "
                "onto another group"
            )
        local = [d for d in trainer.mesh.devices.flat if d.process_index == jax.process_index()]
        memory.log_memory(info, trainer.train_step, local)

    def on_disk(self) -> str:
        """The newest checkpoint on disk, once a save still being written has finished."""
        with contextlib.suppress(StorageError):  # a failed save: the older one is named
            self.checkpoints.wait()
        return self.checkpoints.pending.describe_newest()

    def train(self, stops: StopRequests) -> None:
        """Steps `start + 1 .. steps`: dispatch step N, then read step N-1's metrics (or step
        N's at once where the host must know them), evaluate, save, stop when asked."""
        config, trainer, checkpoints, clock = (
            self.config,
            self.trainer,
            self.checkpoints,
            self.clock,
        )
        self.profiler = Profiler(config, self.start, self.logger.info)
        stops.on_stop_now = lambda: _stop_now(self.data, checkpoints)
        train_iter = iter(self.data.train)
        pending: list[tuple[int, dict[str, Any]]] = []  # dispatched, their read not started
        reading: tuple[list, Any] | None = None  # (steps, their read started, not finished)
        every = _read_every(config)
        stops.loop_started()
        for step in range(self.start + 1, config.steps + 1):
            with stops.stop_now_deferred():  # a second Ctrl-C waits for the batch in hand
                rows = next(train_iter)
            self.count_examples(rows)
            batch = trainer.put_batch(rows)
            step_kwargs = self.profiler.step_kwargs(step)  # starts the trace; engine timing
            clock.dispatching()
            if step == self.start + 1:  # peak bytes per group, measured once (program events)
                self.state, metrics, self.measured_peaks = measured_train_step(
                    trainer, self.state, batch, **step_kwargs
                )
            else:
                self.state, metrics = trainer.train_step(self.state, batch, **step_kwargs)
            clock.dispatched(step, metrics)
            stopping = stops.should_stop(step)
            final = step == config.steps
            # Step N's metrics are read after step N+1 is dispatched (no per-step host sync;
            # several processes: the reads of a log period's steps start together, after its
            # last step's dispatch), except where the host must know them now: before
            # evaluating, before saving (a NaN state is never written, and the next step may
            # donate this one's buffers), and at the end.
            evaluate_now = config.eval_interval > 0 and (step % config.eval_interval == 0 or final)
            saving = stopping or checkpoints.should_save(step, final)
            pending.append((step, metrics))
            if reading is not None:
                self.finish_read(*reading)
                reading = None
            # stopping the trace (and drawing the timeline) is not charged to this step
            clock.exclude(self.profiler.after_step(step, (self.state, metrics), trainer.train_step))
            if evaluate_now or saving or final or len(pending) >= every:
                reading = (pending, jaxpp.fetch_later([m for _, m in pending]))
                pending = []
            if evaluate_now or saving or final:
                self.finish_read(*reading, evaluate_now=evaluate_now)
                reading = None
            checkpoints.check()  # a background save that failed stops the run now
            if stopping:
                raise _stop(step, self.state, self.data, checkpoints, stops)
            if saving:
                checkpoints.save(step, self.state, self.data)
        gaps = clock.gap_summary()
        if gaps:
            self.logger.info(gaps)

    def count_examples(self, rows: dict[str, np.ndarray]) -> None:
        """Adds the chat/preference examples this process's rows say were cut to fit a row or
        left out (`sft_truncation`) to the run's totals (logged from the first such count)."""
        for key in COUNT_KEYS:
            if key in rows:
                self.example_counts[key] = self.example_counts.get(key, 0) + int(rows[key].sum())

    def finish_read(self, steps: list, read: Any, evaluate_now: bool = False) -> None:
        """Finishes `steps` ((step, metrics) pairs) with their metrics' read `read` (blocking
        until the last of them has finished); evaluates after the last if asked."""
        for (step, _), metrics in zip(steps, read.result(), strict=True):
            last = step == steps[-1][0]
            self.finish(step, _scalars(metrics), evaluate_now=evaluate_now and last)

    def finish(self, step: int, values: dict[str, float], evaluate_now: bool) -> None:
        """Checks step `step`'s loss (its metrics `values`, read back), prints MaxText's step
        line, evaluates if asked and writes a record when one is due."""
        config = self.config
        seconds = self.clock.step_seconds(step)
        self.window.append(seconds)
        if not math.isfinite(values["loss"]):
            raise TrainingDivergedError(
                f"loss is {values['loss']} at step {step}; aborting "
                f"(try a lower learning_rate or a gradient_clipping_threshold); {self.on_disk()}"
            )
        self.logger.advance(step, values["loss"])
        self.logger.step_line(
            step,
            seconds,
            self.tflops_per_device / seconds,
            config.tokens_per_step / seconds / config.num_devices,
            values["tokens"],
            values["loss"],
        )
        evaluated: dict[str, Any] = {}
        if evaluate_now:
            eval_loss, n = evaluate(
                self.trainer, self.state["params"], self.data.eval_batches(), config.eval_steps
            )
            evaluated.update(eval_loss=eval_loss, eval_batches=n)
            self.clock.restart()  # do not charge evaluation to the next step
        if evaluate_now or step % config.log_period == 0 or step == config.steps:
            self.record(step, values, evaluated)

    def record(self, step: int, values: dict[str, float], evaluated: dict[str, Any]) -> None:
        """Writes the metrics record of `step` (step time averaged since the last record)."""
        config = self.config
        step_time = sum(self.window) / len(self.window)
        achieved = self.tflops_per_device / step_time
        record = {
            "step": step,
            "loss": values["loss"],
            "step_time_s": step_time,
            "tokens_per_s_per_device": config.tokens_per_step / step_time / config.num_devices,
            "tflops_per_s_per_device": achieved,
            "mfu": flops.mfu(achieved, self.peak),
            "grad_norm": values["grad_norm"],
            "raw_grad_norm": values["raw_grad_norm"],
            "learning_rate": values["learning_rate"],
            "total_weights": values["tokens"],
            "tokens": values["tokens"],
            **{k: v for k, v in values.items() if k not in STEP_METRICS},  # DPO's rewards
            **evaluated,
        }
        if config.use_sft or config.use_dpo:  # the tokens the loss counts: assistant / response
            record["trained_tokens"] = values["tokens"]
            record.update(self.example_counts)
        if self.measured_peaks is not None:
            record["peak_bytes_per_group"] = self.measured_peaks
            self.measured_peaks = None
        try:
            self.logger.write(record)
        except OSError as e:
            raise StorageError(
                f"writing metrics to {config.metrics_file} failed: {os_reason(e)}; {self.on_disk()}"
            ) from e
        self.window.clear()
        self.last = record

    def close(self, after_error: bool = False) -> None:
        """Stops the profiler, the logger and the data workers, and waits for an async save
        still being written (after an error, the error in flight is the one reported)."""
        if self.profiler is not None:
            self.profiler.close()
        self.logger.close()
        _close_data(self.data)
        if after_error:
            with contextlib.suppress(Exception):
                self.checkpoints.close()
        else:
            self.checkpoints.close()


def _stop(step: int, state: Any, data: Any, checkpoints: Checkpoints, stops: StopRequests):
    """Saves `step` after a stop request; returns the `Stopped` to raise."""
    why = (
        signal.Signals(stops.signum).name
        if stops.signum is not None
        else "SIGTERM (a preemption notice to this job)"
    )
    code = stops.exit_code
    if checkpoints.should_save(step, final=True):  # checkpointing is on
        checkpoints.save(step, state, data, wait=True)
        where = f"checkpoint step {step} is on disk ({checkpoints.directory / str(step)})"
    else:
        where = "enable_checkpointing=false, nothing saved"
    return Stopped(f"{why}: stopped after step {step}; {where}; exit code {code}", code)


def model_description(config: Config) -> str:
    """The preset's name, or, for a model loaded from `load_parameters_path` (whose keys may
    override the default preset's), its shapes."""
    block = config.decoder_block
    if not config.load_parameters_path:
        return f"{config.model_name} ({block})"
    return (
        f"{block}, {config.num_decoder_layers} layers, emb_dim {config.emb_dim}, "
        f"{config.num_query_heads}/{config.num_kv_heads} heads of {config.head_dim}, mlp_dim "
        f"{config.mlp_dim}, vocab {config.vocab_size} (from load_parameters_path)"
    )


def _close_data(data: Any) -> None:
    close = getattr(data, "close", None)
    if close is not None:
        close()


def _stop_now(data: Any, checkpoints: Checkpoints) -> str:
    """A second Ctrl-C: stop the data workers (in order: killed ones would leave their shared
    memory to the resource tracker's warnings); say what is on disk (nothing is saved now)."""
    _close_data(data)
    checkpoints.abandon()
    return checkpoints.pending.describe_newest()


def main(argv: Sequence[str]) -> int:
    """Entry point; returns the process exit code (`MaxText/exit_codes.py`)."""
    from MaxText.config import tool_help

    if (words := tool_help.requested(argv)) is not None:  # --help [WORD]: usage and keys
        return tool_help.show("train", words)
    setup_logging()
    with StopRequests() as stops:
        try:
            return _main(argv, stops)
        except StoppedBeforeStart as e:
            print(f"{e}: stopped before the first step; nothing new to save", file=sys.stderr)
            return exit_codes.after_signal(e.signum)
        except Stopped as e:
            log.info(str(e))
            return e.exit_code


def _make_data(config: Config) -> Any:
    from MaxText.data import make_data
    from MaxText.data.errors import DataError

    try:
        return make_data(config)
    except ValueError as e:  # the data modules' plain ValueErrors are unusable data settings
        if exit_codes.exit_code_of(e) is not None:
            raise
        raise DataError(str(e)) from None


def _main(argv: Sequence[str], stops: StopRequests) -> int:
    debug = False
    try:
        config = load_config(argv)
        debug = config.debug_tracebacks
        if config.steps == 0:
            log.info("steps=0: nothing to train (set steps= to the step to train up to)")
            return exit_codes.OK
        require_tokenizer(config)  # from a converted checkpoint: its own tokenizer, never a new one
        xla_flags.apply_gpu_defaults(config.hardware)  # before the backend starts
        config, devs = devices.start(config)  # processes and -1 axes decided, devices ready
        gpu_host.check_backend(
            devs[0].platform,
            hardware=config.hardware,
            allow_cpu_fallback=config.allow_cpu_fallback,
        )
        stops.cluster_started()  # several processes: JAX's preemption notifier takes SIGTERM
        check_model_before_compiling(config)  # a checkpoint of another model: exit 2 now
        data = _make_data(config)
        # Creates the run's folders: after every config, device and data check (a refused run
        # leaves nothing behind) and before anything is compiled.
        check_run_paths(config)
    except Exception as e:
        code = exit_codes.report(e, debug=debug)
        if code is None:
            raise
        return code
    from MaxText.cluster.compile_cache import compilation_cache
    from MaxText.planning.auto import resolve_auto

    try:
        with compilation_cache(config.jax_cache_dir):
            config = resolve_auto(config)  # "auto" schedule, microbatches, split, remat
            mesh = sharding.make_mesh(config, devs)
            trainer = build_trainer(config, mesh)
            last = run(config, trainer, data, stops)
    except Exception as e:  # e.g. a checkpoint of another model or seed, a full disk, a NaN
        code = exit_codes.report(e, debug=debug)
        if code is None:
            raise
        return code
    finally:
        _close_data(data)
    if last:
        summary = f"done: {config.steps} steps, loss {last['loss']:.4f}"
        if "eval_loss" in last:
            summary += f", eval_loss {last['eval_loss']:.4f}"
        log.info(summary + f"; metrics in {config.metrics_file}")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
