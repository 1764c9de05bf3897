"""Stopping like a cluster job: SIGTERM and SIGINT ask the trainer to stop after the step in flight.

A scheduler preempts a job with SIGTERM (SLURM, Kubernetes: then SIGKILL after a grace period);
a user stops it with Ctrl-C (SIGINT). `StopRequests` turns either into a request that the loop
reads after dispatching each step (`should_stop(step)`): the loop then finishes that step, saves
it, says in one line which step is on disk, stops its data workers and exits with 128 + the
signal's number (`exit_code`: 143 for SIGTERM, 130 for SIGINT).

- **One process**: Python handlers for SIGTERM and SIGINT set the request. A second SIGINT stops
  at once without saving (`stop_now`: the loop's `on_stop_now` callback stops the data workers
  and names the newest checkpoint on disk, then the process exits 130; checkpoints already
  written are untouched, a save in flight is left as a temporary folder the next run removes).
  A second SIGINT during the loop's data fetch (`stop_now_deferred`) takes effect when the fetch
  ends (at most `STOP_NOW_WAIT_S` later), never inside grain's reader.
  A signal that arrives before the first step (while compiling) stops the process right away
  (`StoppedBeforeStart`): there is nothing new to save.
- **Several processes** (`jax.distributed` started): SIGTERM is left to JAX's preemption notifier,
  which the coordination service relays to every process; `should_stop` asks JAX's sync point
  (`multihost_utils.reached_preemption_sync_point`, called every step by every process), which
  is true on every process at the same step, so all of them save the same step even when the
  signal reached one process only. A Python SIGTERM handler cannot be used there: installed after
  `jax.distributed.initialize` it disables JAX's notifier, installed before it is replaced. SIGINT
  reaches agreement the same way: its handler sends this process a SIGTERM, i.e. files a
  preemption notice. Processes that got SIGINT exit 130, the others 143. A second SIGINT stops
  that process at once; its peers then stop when the coordination service's heartbeat (or the
  `pipeline_hang_timeout_s` watchdog) declares it lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from MaxText import exit_codes

log = logging.getLogger("MaxText")

SIGNALS = (signal.SIGTERM, signal.SIGINT)

# How long a second Ctrl-C waits for a deferring block (`stop_now_deferred`: the loop's data
# fetch) to end before stopping anyway: a fetch takes milliseconds; one that hangs must not keep
# the process from stopping.
STOP_NOW_WAIT_S = 5.0


class StoppedBeforeStart(BaseException):  # noqa: N818 (not an error: a requested stop)
    """A stop signal arrived before the first training step; nothing new to save."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _jax_preemption_sync() -> Callable[[int], bool] | None:
    """JAX's preemption sync point when `jax.distributed` runs its preemption service."""
    import jax

    if not (jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service):
        return None
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point


class StopRequests:
    """Signal handling for one run (a context manager; see the module docstring).

    Enter it early (before compiling), call `cluster_started()` once `jax.distributed` may have
    started, and `loop_started()` when the loop begins.
    """

    def __init__(self) -> None:
        self.signum: int | None = None  # the first stop signal this process received
        self.on_stop_now: Callable[[], str] = lambda: ""  # cleanup before exiting at once
        self._started = False
        self._sync: Callable[[int], bool] | None = None
        self._previous: dict[int, object] = {}
        self._deferring = 0  # depth of `stop_now_deferred` blocks the main thread is in
        self._deferred: int | None = None  # a second SIGINT waiting for that block to end
        self._exiting: int | None = None  # the thread running `stop_now`

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: the caller there handles them
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def cluster_started(self) -> None:
        """Under `jax.distributed`, JAX's preemption notifier now owns SIGTERM (it replaced the
        handler installed by `__enter__`): stop requests come from its sync point."""
        self._sync = _jax_preemption_sync()
        if self._sync is not None:
            self._previous.pop(signal.SIGTERM, None)  # never touch SIGTERM again

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    @property
    def multiprocess(self) -> bool:
        return self._sync is not None

    def loop_started(self) -> None:
        self._started = True
        if self.signum is not None and not self.multiprocess:
            raise StoppedBeforeStart(self.signum)

    def should_stop(self, step: int) -> bool:
        """Whether to save `step` and stop (every process gets the same answer at every step)."""
        if self._sync is not None:
            return bool(self._sync(step))
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        # several processes: a peer's preemption notice counts as SIGTERM
        return exit_codes.after_signal(self.signum or signal.SIGTERM)

    @contextlib.contextmanager
    def stop_now_deferred(self) -> Iterator[None]:
        """A block a second Ctrl-C must not cut short (the loop's data fetch: the handler runs
        in the main thread, and stopping the data workers from inside their reader, mid-batch,
        can leave that batch's shared memory behind or wait on a lock the reader holds). A
        second SIGINT inside it stops the process when the block ends, or after
        `STOP_NOW_WAIT_S` if it does not."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if self._deferring == 0 and self._deferred is not None:
                self.stop_now(self._deferred)

    def _handle(self, signum: int, _frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT and self._deferred is None:
                if self._deferring:
                    self._deferred = signum
                    late = threading.Timer(STOP_NOW_WAIT_S, self.stop_now, (signum,))
                    late.daemon = True
                    late.start()
                else:
                    self.stop_now(signum)
            return  # a repeated SIGTERM changes nothing
        self.signum = signum
        name = signal.Signals(signum).name
        if not self._started:
            raise StoppedBeforeStart(signum)
        if self._sync is not None:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice to every process
        log.info(
            "%s: saving after the step in flight, then stopping%s",
            name,
            " (Ctrl-C again to stop at once without saving)" if signum == signal.SIGINT else "",
        )

    def stop_now(self, signum: int) -> None:
        """Exits at once with 128 + `signum` after the loop's `on_stop_now` cleanup. Once: the
        end of a deferring block and its timer may both call it (the second waits for the
        exit), and a Ctrl-C during the cleanup returns to it."""
        if self._exiting == threading.get_ident():
            return
        _STOP_NOW_LOCK.acquire()  # never released: os._exit follows
        self._exiting = threading.get_ident()
        self._stop_now(signum)

    def _stop_now(self, signum: int) -> None:
        try:
            tail = self.on_stop_now()
        except Exception as e:  # noqa: BLE001 (exiting anyway: say why the cleanup failed)
            tail = f"cleanup failed: {exit_codes.first_line(e)}"
        print(
            f"{signal.Signals(signum).name} again: stopping now without saving"
            + (f"; {tail}" if tail else ""),
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        _release_process_semaphores()
        os._exit(exit_codes.after_signal(signum))


_STOP_NOW_LOCK = threading.Lock()  # taken by the one `stop_now` that exits


def _release_process_semaphores() -> None:
    """Runs the exit-time cleanups of multiprocessing's own objects in this process (the
    semaphores of the data workers' queues: unlinked and unregistered), which `os._exit` skips;
    the resource tracker would otherwise unlink them itself and warn of "leaked semaphore
    objects". Cleanups of priority < 0 (joining queue feeder threads) are not run: they may
    block. A stdlib function without a public spelling, hence the guard."""
    import multiprocessing.util

    run = getattr(multiprocessing.util, "_run_finalizers", None)
    if run is not None:
        try:
            run(0)
        except Exception:  # noqa: BLE001 (exiting anyway; the tracker still cleans up)
            pass
