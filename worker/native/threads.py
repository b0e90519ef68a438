"""How many threads the native forward pass uses, chosen from the steps' own timings.

Why: the pass splits every product over the cores and meets at a barrier about ten times per
layer. On a quiet machine that is right (two cores read the weights faster than one). On a
machine whose cores are shared with other busy processes, each barrier waits for whichever
thread the kernel has descheduled: on the 2-core development VM under load 12-15 a one-row
step of SmolLM2 took ~50 ms on one thread and ~220 ms on two. Which is faster changes with the
machine's load, so it is measured, as the weight layout is at start-up, but all along: every
``EVERY`` steps a few steps run with each team size, interleaved, and the faster one (per
token, median) is kept until the next measurement. A user's OMP_NUM_THREADS is kept as it is.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EVERY = 256  # steps between measurements
TRIALS = 3  # steps per team size in a measurement


class TeamSize:
    """The team size for each pass: all usable cores or one, whichever measured faster."""

    def __init__(self, most: int, apply: Callable[[int], None], fixed: bool) -> None:
        self._sizes = (most, 1) if most > 1 and not fixed else (most,)
        self._apply = apply
        self.current = most
        self._plan: list[int] = []
        self._seen: dict[int, list[float]] = {}
        self._steps = 0

    def _set(self, n: int) -> None:
        if n != self.current:
            self._apply(n)
            self.current = n

    @contextmanager
    def step(self, tokens: int) -> Iterator[None]:
        """Run one pass of ``tokens`` tokens (rows x new) under the chosen team size."""
        if len(self._sizes) < 2:
            yield
            return
        if not self._plan and self._steps % EVERY == 0:
            self._plan = [n for _ in range(TRIALS) for n in self._sizes]
            self._seen = {n: [] for n in self._sizes}
        self._steps += 1
        trial = self._plan.pop(0) if self._plan else None
        if trial is not None:
            self._set(trial)
        start = time.perf_counter()
        yield
        if trial is None:
            return
        self._seen[trial].append((time.perf_counter() - start) / tokens)
        if not self._plan:
            self._set(min(self._sizes, key=lambda n: statistics.median(self._seen[n])))
