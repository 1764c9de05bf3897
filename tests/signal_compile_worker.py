"""Runs `MaxText.train.main` and sends the process SIGTERM while XLA compiles the step, for
tests/test_exit_codes.py::test_a_signal_while_compiling_stops_after_the_compile_in_flight.

    python tests/signal_compile_worker.py <out.json> configs/base.yml key=value ...

A thread watches whether the main thread is inside XLA's compile call and sends SIGTERM once it
is; the trainer's handler runs when that C++ call returns. Writes to <out.json>: the trainer's
exit code, whether `build_trainer` returned, its stderr lines, and the monotonic times the
signal was sent, the compile in flight returned and `main` returned, and how many compiles
started after it. Exits 0 once that is written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import threading
import time

from MaxText import train as train_lib


class _MainThreadCompiles:
    """Watches, from another thread, whether the main thread is inside XLA's compile call (a C++
    call in which Python runs no signal handler): its stack holds JAX's `backend_compile_and_load`
    frame. Sends SIGTERM once the first compile after `start()` is in flight, then records when
    that compile returns and whether another one starts."""

    FRAME = "backend_compile_and_load"

    def __init__(self):
        self.started = threading.Event()
        self.done = threading.Event()
        self.sent = self.left = None
        self.compiles_after = 0
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def compiling(self) -> bool:
        frame = sys._current_frames().get(self._main)
        while frame is not None:
            if frame.f_code.co_name == self.FRAME:
                return True
            frame = frame.f_back
        return False

    def _poll(self, until, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline or self.done.is_set():
                return False
            time.sleep(0.0005)
        return True

    def _watch(self):
        self.started.wait()
        if not self._poll(self.compiling, 120):
            return
        self.sent = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        self._poll(lambda: not self.compiling(), 600)
        self.left = time.monotonic()
        while not self.done.is_set():  # a later compile would be seen between polls
            if self._poll(self.compiling, 600):
                self.compiles_after += 1
                self._poll(lambda: not self.compiling(), 600)

    def join(self):
        self.done.set()
        self._thread.join(60)


def main(out: str, argv: list[str]) -> int:
    watcher = _MainThreadCompiles()
    real_build = train_lib.build_trainer
    built = []

    def build_trainer(*args, **kwargs):
        watcher.started.set()
        built.append(real_build(*args, **kwargs))  # raises out of the compile in flight
        return built[-1]

    train_lib.build_trainer = build_trainer
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = train_lib.main(argv)
        returned = time.monotonic()
    finally:
        watcher.join()
    seen = {
        "code": code,
        "built": bool(built),
        "stderr": [line for line in err.getvalue().splitlines() if line.strip()],
        "sent": watcher.sent,
        "left": watcher.left,
        "returned": returned,
        "compiles_after": watcher.compiles_after,
    }
    with open(out, "w") as f:
        json.dump(seen, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
