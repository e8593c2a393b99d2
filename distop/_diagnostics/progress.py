"""Progress of long work on rank 0: a bar on a terminal, a line every few seconds else.

Work that may run for minutes (`check_totals` of an implicit operator, say) goes
through a few steps, the longest of which is one program call that Python does not see
into. A `Progress` names the step under way and, from a thread of its own, shows it
with the time it has taken, once the work has run `AFTER` seconds: short work prints
nothing more than it did before.
"""

import threading
import time
from typing import Any

AFTER = 3.0  # seconds of work before the first report
EVERY = 5.0  # seconds between lines where the stream is not a terminal
TICK = 0.25  # seconds between redraws of the bar on a terminal
WIDTH = 20  # characters of the bar


class Progress:
    """A context manager reporting progress of `what` on `stream`.

    **Arguments:**
    - `what`: the work, for each line (`"check_totals"`).
    - `total`: its number of steps.
    - `stream`: where to report (a bar where it is a terminal); None reports nothing
      (the other ranks, or progress turned off).
    """

    def __init__(self, what: str, total: int, stream: Any) -> None:
        self.what, self.total, self.stream = what, total, stream
        self.done, self.step = 0, ""
        self._started = time.perf_counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._drawn = False  # a bar stands on the terminal's last line
        self._bar = bool(getattr(stream, "isatty", lambda: False)())

    def __enter__(self) -> "Progress":
        if self.stream is not None:
            self._thread = threading.Thread(target=self._report, daemon=True,
                                            name=f"distop {self.what} progress")
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._drawn:
                self._write(self._line(self.total if exc[0] is None else self.done) + "\n")

    def next(self, step: str) -> None:
        """Start step `step` (in words: `"evaluating 96 perturbed points"`), counting the
        one before it as done."""
        with self._lock:
            if self.step:
                self.done += 1
            self.step = step

    def say(self, text: str) -> None:
        """Print `text` on its own line, past a bar drawn on the terminal."""
        if self.stream is None:
            return
        with self._lock:
            if self._drawn:
                self._write("\r" + " " * (WIDTH + 80) + "\r")
                self._drawn = False
            self._write(text + "\n")

    def _line(self, done: int) -> str:
        took = time.perf_counter() - self._started
        if self._bar:
            filled = WIDTH * done // max(self.total, 1)
            return (f"\r{self.what} [{'#' * filled}{'-' * (WIDTH - filled)}] "
                    f"{done}/{self.total} {self.step[:60]}, {took:.0f} s")
        return f"{self.what}: step {done + 1} of {self.total}, {self.step}; {took:.0f} s so far"

    def _report(self) -> None:
        if self._stop.wait(AFTER):
            return
        while True:
            with self._lock:
                if self.step:  # (nothing to tell before the first step starts)
                    self._write(self._line(self.done) + ("" if self._bar else "\n"))
                    self._drawn = self._bar
            if self._stop.wait(TICK if self._bar else EVERY):
                return

    def _write(self, text: str) -> None:
        if self.stream is None:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # (a closed stream: progress is not worth failing)
            self.stream = None
