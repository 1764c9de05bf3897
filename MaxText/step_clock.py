"""Honest step times without a per-step host sync, and the host's time between dispatches.

The loop reads step N's metrics only after it has dispatched step N+1 (the host stays ahead), so
the moment it reads them says little about when step N finished: a pipelined step on CPU runs
most of its tasks while it is being dispatched, a GPU step long after. `StepClock` therefore
looks, without waiting, whether each dispatched step's outputs are ready at a few points of the
loop (right after its dispatch returns, before the next dispatch, after it) and takes the first
time it sees them ready as the step's end; a step still running when its metrics are read ends
when the read returns. A step's time is the interval between consecutive ends, as before, so
on CPU (steps complete during their own dispatch) it is exact, and on an accelerator it is at
most one dispatch late.

It also records the host's gap between the end of one step's dispatch and the start of the
next: what the devices may idle for (`gap_summary`, logged at the end of a run).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax


def _ready(tree: Any) -> bool:
    """Whether this process's arrays of `tree` are computed (never waits)."""
    for leaf in jax.tree.leaves(tree):
        arrays = getattr(leaf, "arrays", None)  # an MpmdArray: its local groups' arrays
        for a in arrays.values() if isinstance(arrays, dict) else (leaf,):
            is_ready = getattr(a, "is_ready", None)
            if is_ready is not None and not is_ready():
                return False
    return True


class StepClock:
    """Step ends and dispatch gaps of one run's loop (see the module docstring)."""

    def __init__(self) -> None:
        self._last_end = time.perf_counter()  # end of the previous step (or the loop's start)
        self._running: dict[int, Any] = {}  # dispatched steps whose end is not seen yet
        self._ends: dict[int, float] = {}
        self._dispatch_end: float | None = None
        self._prev_look = self._last_end
        self.gaps: list[float] = []  # host seconds between consecutive dispatches
        self.steps: list[float] = []  # step times handed out by `step_seconds`

    def dispatching(self) -> None:
        """Call right before a step is dispatched."""
        now = time.perf_counter()
        self.look()
        if self._dispatch_end is not None:
            self.gaps.append(now - self._dispatch_end)

    def dispatched(self, step: int, outputs: Any) -> None:
        """Call right after `step`'s dispatch returned, with outputs to watch (its metrics)."""
        self._dispatch_end = time.perf_counter()
        self._running[step] = outputs
        self.look()

    def look(self) -> None:
        """Notes the end of every watched step that is ready now. When several are first seen
        ready at once, the older ones ended before the previous look could tell: they get that
        look's time (a lower bound), the newest gets now, so no step's time is zero."""
        now = time.perf_counter()
        ready = sorted(s for s, out in self._running.items() if _ready(out))
        for step in ready:
            self._ends[step] = now if step == ready[-1] else max(self._prev_look, self._last_end)
            del self._running[step]
        self._prev_look = now

    def step_seconds(self, step: int) -> float:
        """`step`'s time, once its metrics were read (blocking): its end minus the previous end."""
        self.look()
        end = self._ends.pop(step, None)
        if end is None:  # still running when read: it ended when the read returned
            self._running.pop(step, None)
            end = time.perf_counter()
        seconds, self._last_end = max(end - self._last_end, 1e-6), max(end, self._last_end)
        self.steps.append(seconds)
        return seconds

    def exclude(self, seconds: float) -> None:
        """Host work between steps not to charge to the next step (evaluation, profiler)."""
        self._last_end += seconds
        if self._dispatch_end is not None:
            self._dispatch_end += seconds

    def restart(self) -> None:
        """The next step's time starts now (after an evaluation); no gap is counted across it."""
        self._last_end = time.perf_counter()
        self._dispatch_end = None

    def gap_summary(self) -> str | None:
        """One line: the median host gap between dispatches, and its share of the median step."""
        if not self.gaps or not self.steps:
            return None
        gap, step = statistics.median(self.gaps), statistics.median(self.steps)
        return (
            f"host time between step dispatches: median {1e3 * gap:.2f} ms over "
            f"{len(self.gaps)} steps, {100 * gap / step:.1f}% of the median step "
            f"({1e3 * step:.1f} ms)"
        )
