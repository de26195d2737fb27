"""A dependency-free progress bar per build stage, on stderr.

On a terminal it redraws one line per stage; elsewhere (CI logs, pipes) it prints the stage
once when it starts and once when it ends, so logs stay short.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, stage: str, total: int, enabled: bool = True, stream=None):
        self.stage, self.total, self.done = stage, max(total, 1), 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        if enabled and not self.tty:
            print(f"[{stage}] {total} step(s)...", file=self.stream, flush=True)
        self._draw("")

    def step(self, what: str = "") -> None:
        self.done += 1
        self._draw(what)

    def close(self, note: str = "") -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        line = f"[{self.stage}] {self.done}/{self.total} done in {elapsed:.1f} s" + (f" ({note})" if note else "")
        print(("\r" + line.ljust(100)) if self.tty else line, file=self.stream, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()

    def _draw(self, what: str) -> None:
        if not self.tty:
            return
        width = 30
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "-" * (width - filled)
        print(f"\r[{self.stage}] [{bar}] {self.done}/{self.total} {what[:40]}".ljust(100), end="",
              file=self.stream, flush=True)
