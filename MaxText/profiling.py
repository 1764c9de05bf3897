"""The profiler (`profiler=xplane`, MaxText's keys): a `jax.profiler` trace of a few steps and,
when pipelined, the measured pipeline timeline of one of them.

Steps are numbered from 1 as in the training loop. With `skip_first_n_steps_for_profiler=K` and
`profiler_steps=N`, a run starting after step S (0 for a fresh run, else the restored step) traces
steps S+K+1 ... S+K+N (clipped to `steps`): the trace starts before the first of them is
dispatched and stops after the last has finished. `jax.profiler` writes it under
`<run>/tensorboard/plugins/profile/<timestamp>/` (open it with TensorBoard's profile plugin,
XProf or Perfetto: the `.trace.json.gz` next to the `.xplane.pb`).

Pipelined runs: the last traced step is called with the engine's `record_times=True`, which
blocks on every task and records its start and end (`compiled.last_events`); that step's tasks
therefore run one at a time. Its timeline (one row per pipeline group, one box per task) is
written to `<run>/pipeline_timeline_step<N>.png`, and the same measured task durations replayed
by the schedule simulator (the overlap a normal step gets back) to
`<run>/pipeline_timeline_step<N>_simulated.png`; one log line summarises both.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax

from MaxText.config import Config

log = logging.getLogger(__name__)


class Profiler:
    """Starts and stops the trace around the chosen steps; the loop calls `step_kwargs(step)`
    before dispatching a step, `after_step(step, outputs)` after it and `close()` at the end."""

    def __init__(self, config: Config, start_step: int, info: Callable[[str], None] = log.info):
        self.config = config
        self.info = info
        self.first = start_step + 1 + config.skip_first_n_steps_for_profiler
        self.last = min(self.first + config.profiler_steps - 1, config.steps)
        self.enabled = config.profiler == "xplane" and self.first <= config.steps
        self.trace_dir = config.tensorboard_dir  # jax.profiler adds plugins/profile/<timestamp>
        self.timeline_path = ""
        self._tracing = False
        if config.profiler and not self.enabled:
            info(
                f"profiler: nothing to trace: the run ends at step {config.steps}, before "
                f"step {self.first} (skip_first_n_steps_for_profiler="
                f"{config.skip_first_n_steps_for_profiler})"
            )

    def step_kwargs(self, step: int) -> dict[str, Any]:
        """Keyword arguments for this step's call (the engine's task timing on the timeline step);
        starts the trace before the first traced step."""
        if not self.enabled:
            return {}
        if step == self.first:
            os.makedirs(self.trace_dir, exist_ok=True)
            jax.profiler.start_trace(self.trace_dir)
            self._tracing = True
        if step == self.last and self.config.is_pipelined:
            return {"record_times": True}
        return {}

    def after_step(self, step: int, outputs: Any, train_step: Any = None) -> float:
        """Stops the trace once the last traced step has finished and draws the timeline; returns
        the seconds spent after the outputs were ready (0.0 on other steps), which the loop does
        not charge to the step."""
        if not self.enabled or step != self.last:
            return 0.0
        jax.block_until_ready(outputs)
        t_ready = time.perf_counter()
        self._stop()
        self.info(
            f"profiler: traced steps {self.first}-{self.last} to "
            f"{os.path.join(self.trace_dir, 'plugins', 'profile')}"
        )
        if self.config.is_pipelined and train_step is not None:
            self.timeline_path = write_pipeline_timeline(train_step, step, self.config, self.info)
        return time.perf_counter() - t_ready

    def close(self) -> None:
        """Stops a trace still running (the loop ended early or raised)."""
        self._stop()

    def _stop(self) -> None:
        if self._tracing:
            jax.profiler.stop_trace()
            self._tracing = False


def write_pipeline_timeline(
    compiled: Any, step: int, config: Config, info: Callable[[str], None]
) -> str:
    """PNGs of the step `compiled` just ran with `record_times=True` (measured, and simulated
    from the measured task durations); returns the measured one's path."""
    from jaxpp_integration.tools import measure, timeline

    summary = measure.measure_step(compiled.last_events, compiled.schedule)
    suffix = f"_process{config.process_id}" if config.num_processes > 1 else ""
    stem = os.path.join(config.output_dir, f"pipeline_timeline_step{step}{suffix}")
    os.makedirs(config.output_dir, exist_ok=True)
    measured = timeline.draw_timeline(
        summary.events,
        summary.num_ranks,
        stem + ".png",
        title=(
            f"step {step}, measured (ms): {config.pipeline_schedule}, "
            f"{summary.n_microbatches} microbatches; tasks timed one at a time"
        ),
    )
    timeline.draw_timeline(
        summary.simulation.events,
        summary.num_ranks,
        stem + "_simulated.png",
        title=f"step {step}: measured task durations (ms) replayed with overlap by the simulator",
    )
    busy = ", ".join(f"{b:.1f}" for b in summary.busy_per_rank)
    info(
        f"pipeline timeline of step {step}: {measured} (loop {summary.loop_span:.1f} ms, "
        f"busy per group [{busy}] ms, outside the loop {summary.outside_loop:.1f} ms; "
        f"simulated with overlap {summary.simulated_makespan:.1f} ms, "
        f"bubble {100 * summary.simulated_bubble:.0f}%)"
    )
    return str(measured)
