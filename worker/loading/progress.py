"""A progress line while the worker starts: which step, how long so far, how much memory.

Why: a 1B-8B model takes tens of seconds to get ready on a CPU, and a worker that says nothing
for that long looks hung. While a step runs, one log line (INFO, like the other load lines:
`--log-level info`) every ``every`` seconds says what it is doing, for how long, the process's
resident memory and, where the step knows it, how far it got (``advance``: bytes or layers).
The line for a step's end gives its duration, so the log alone says where a start's time went.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("kiln.worker.load")

DEFAULT_EVERY_S = 5.0


def resident_mb() -> float | None:
    """This process's resident memory in MB (10^6 bytes), from /proc; None where unreadable."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


class LoadProgress:
    """Steps of one start, each timed and reported while it runs."""

    def __init__(self, model: str, every: float = DEFAULT_EVERY_S) -> None:
        self.model = model
        self.every = every
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._done: tuple[int, int, str] | None = None  # (done, total, unit) of the current step

    def advance(self, done: int, total: int, unit: str = "bytes") -> None:
        """How far the current step got (any thread; the next progress line shows it)."""
        with self._lock:
            self._done = (done, total, unit)

    def _amount(self) -> str:
        with self._lock:
            done = self._done
        if done is None:
            return ""
        n, total, unit = done
        if unit == "bytes":
            return f", {n / 1e6:.0f} of {total / 1e6:.0f} MB ({100 * n / max(total, 1):.0f} %)"
        return f", {n} of {total} {unit}"

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time `name`; log a line every `every` seconds until it ends, then its duration."""
        with self._lock:
            self._done = None
        began = time.monotonic()
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(self.every):
                rss = resident_mb()
                log.info(
                    "loading %s: %s for %.0f s%s%s", self.model, name, time.monotonic() - began, self._amount(),
                    f", {rss:.0f} MB resident" if rss is not None else "",
                    extra={"model": self.model, "step": name, "seconds": round(time.monotonic() - began, 1), "rss_mb": rss and round(rss)},
                )  # fmt: skip

        ticker = threading.Thread(target=tick, name="kiln-load-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            rss = resident_mb()
            seconds = time.monotonic() - began
            log.info(
                "loading %s: %s took %.1f s (%.1f s since start)%s", self.model, name, seconds, time.monotonic() - self.started,
                f", {rss:.0f} MB resident" if rss is not None else "",
                extra={"model": self.model, "step": name, "seconds": round(seconds, 2), "rss_mb": rss and round(rss)},
            )  # fmt: skip
