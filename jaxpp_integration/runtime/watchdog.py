"""Hang watchdog for several processes: say where the schedule is stuck, then exit.

Under multi-controller JAX a peer that stops (crashed device, stopped process, lost network)
leaves the others blocked forever in a cross-process transfer, with no hint of where. With
`pipeline_hang_timeout_s=T` the runtime hands every cross-process transfer it issues to a
`Watchdog` (its result array, the instruction index, the task that produced the value, the
microbatch, the two groups), and marks the instruction it is dispatching. A background thread
polls: when a watched transfer is still not done T seconds after it was issued, or the
dispatching thread has been inside one instruction for T seconds, it prints one line naming the
instruction, task, microbatch and the group (and process) waited on, and ends the process with
exit code `HANG_EXIT_CODE` (`os._exit`: a blocked thread cannot unwind). Every process runs its
own watchdog, so each one waiting on the lost peer exits the same way.

Nothing already saved is touched: checkpoints become visible only by an atomic rename once
complete (orbax), so exiting mid-write leaves a temporary folder, never a damaged checkpoint.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

HANG_EXIT_CODE = 3
_POLL_S = 0.25


class Watchdog:
    """One per compiled function; its thread starts with the first watched step."""

    def __init__(self, timeout_s: float, describe):
        """`describe(instruction_index)` -> text naming the instruction (called only on a hang)."""
        self.timeout_s = float(timeout_s)
        self.describe = describe
        self.pending: collections.deque = collections.deque()  # (t0, index, array)
        self.current: tuple | None = None  # (t0, index) of the instruction being dispatched
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxpp-watchdog", daemon=True)
            self._thread.start()

    def enter(self, index: int) -> None:
        self.current = (time.monotonic(), index)

    def leave(self) -> None:
        self.current = None

    def watch(self, index: int, array) -> None:
        """Expect `array` (the result of instruction `index`: an array or a list of them, e.g.
        a transfer batch's outputs) to become ready in time."""
        if array is not None:
            with self._lock:
                self.pending.append((time.monotonic(), index, array))

    def _run(self) -> None:
        while True:
            time.sleep(_POLL_S)
            now = time.monotonic()
            cur = self.current
            if cur is not None and now - cur[0] > self.timeout_s:
                self._fire(cur[1], now - cur[0], "dispatching")
            with self._lock:
                while self.pending and _ready(self.pending[0][2]):
                    self.pending.popleft()
                oldest = self.pending[0] if self.pending else None
            if oldest is not None and now - oldest[0] > self.timeout_s:
                self._fire(oldest[1], now - oldest[0], "waiting for")

    def _fire(self, index: int, waited: float, doing: str) -> None:
        try:
            where = self.describe(index)
        except Exception as e:  # pragma: no cover - the message must go out regardless
            where = f"instruction {index} ({e!r})"
        msg = (
            f"jaxpp pipeline hang: process {_process_index()} {doing} {where} for {waited:.1f} s "
            f"(pipeline_hang_timeout_s={self.timeout_s:g}); a peer process is stopped or lost; "
            f"exiting with code {HANG_EXIT_CODE}"
        )
        try:
            sys.stdout.flush()
            print(msg, file=sys.stderr, flush=True)
        finally:
            os._exit(HANG_EXIT_CODE)


def _ready(array) -> bool:
    """An array, or every array of a batch's outputs (a list), is done."""
    if isinstance(array, (list, tuple)):
        return all(_ready(a) for a in array)
    try:
        return array.is_ready()
    except Exception:  # a deleted or donated buffer is no longer waited on
        return True


def _process_index() -> int:
    import jax

    return jax.process_index()


def describe_instruction(prog, index: int, local_ranks, owner) -> str:
    """'instruction 12 of 40 (transfer of fwd_0__3's output, microbatch 3, group 0 -> group 1;
    waits on group 1, process 1)'. `owner(rank)` is the process holding a group."""
    from jaxpp_integration.compiler.program import Run, Transfer

    ins = prog.instrs[index]
    head = f"instruction {index} of {len(prog.instrs)}"
    if isinstance(ins, Transfer):
        run = next((i for i in prog.instrs if isinstance(i, Run) and ins.src in i.outs), None)
        task = run.name if run is not None else f"slot {ins.src}"
        mb = run.microbatch if run is not None else None
        peer = ins.dst_rank if ins.src_rank in local_ranks else ins.src_rank
        return (
            f"{head} (transfer of {task}'s output, microbatch {mb}, group {ins.src_rank} -> "
            f"group {ins.dst_rank}; waits on group {peer}, process {owner(peer)})"
        )
    if isinstance(ins, Run):
        return f"{head} (task {ins.name}, microbatch {ins.microbatch}, group {ins.code.rank})"
    return f"{head} ({type(ins).__name__})"
