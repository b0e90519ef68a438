"""Request preparation off the I/O thread: a few threads behind a bounded queue.

Rendering a chat template, tokenizing, compiling a grammar (the first one waits for the
llguidance tokenizer view) can take seconds for a big or unlucky request. The I/O loop that
runs them would stop heartbeating meanwhile, and the gateway would declare the whole worker
dead. So the I/O loop only hands each job to this pool; when the queue is full it answers the
request with 503 at once instead of queueing unbounded work (and memory).

The queue is bounded in work as well as in jobs: each job weighs what it will render and tokenize
(characters of its request), and past ``max_weight`` waiting or running the next is refused
(503, which the gateway retries elsewhere or passes on with Retry-After). Forty prompts just
under the window bound at once were 24 MB of text to tokenize, two threads behind, while the
worker's I/O loop and heartbeats competed for the interpreter until the gateway dropped it.
An idle pool always takes a job, whatever it weighs.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("kiln.worker.preparation")

Job = Callable[[], None]

DEFAULT_MAX_WEIGHT = 4 * 1024 * 1024  # characters of requests waiting or being prepared


class Preparer:
    """Runs jobs on ``threads`` daemon threads; at most ``depth`` wait to start, and at most
    ``max_weight`` of work waits or runs."""

    def __init__(self, threads: int = 2, depth: int = 64, max_weight: int = DEFAULT_MAX_WEIGHT) -> None:
        self.max_weight = max_weight
        self._weight = 0  # of the jobs queued or running
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max(1, depth))
        self._threads = [threading.Thread(target=self._work, name=f"kiln-prepare-{i}", daemon=True) for i in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job, weight: int = 0) -> bool:
        """Queue a job; False (and nothing queued) when the queue is full or the work waiting
        and running would pass ``max_weight``."""
        with self._lock:
            if self._weight and self._weight + weight > self.max_weight:
                return False
            self._weight += weight

        def weighed() -> None:
            try:
                job()
            finally:
                with self._lock:
                    self._weight -= weight

        try:
            self._jobs.put_nowait(weighed)
            return True
        except queue.Full:
            with self._lock:
                self._weight -= weight
            return False

    def weight(self) -> int:
        """The work queued or running."""
        return self._weight

    def pending(self) -> int:
        """Jobs waiting to start (not those running)."""
        return self._jobs.qsize()

    def stop(self) -> None:
        """Let the threads finish their current job and end; queued jobs are dropped."""
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            try:
                self._jobs.put(None, timeout=5)
            except queue.Full:  # submits raced in; the threads are daemons anyway
                break

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a job answers its own request; this only keeps the thread alive
                log.exception("request preparation failed")
            finally:
                del job  # a finished job's request must not stay referenced while idle
