"""Request preparation off the I/O thread: a few threads behind a bounded queue.

Rendering a chat template, tokenizing, compiling a grammar (the first one waits for the
llguidance tokenizer view) can take seconds for a big or unlucky request. The I/O loop that
runs them would stop heartbeating meanwhile, and the gateway would declare the whole worker
dead. So the I/O loop only hands each job to this pool; when the queue is full it answers the
request with 503 at once instead of queueing unbounded work (and memory).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("kiln.worker.preparation")

Job = Callable[[], None]


class Preparer:
    """Runs jobs on ``threads`` daemon threads; at most ``depth`` wait to start."""

    def __init__(self, threads: int = 2, depth: int = 64) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max(1, depth))
        self._threads = [threading.Thread(target=self._work, name=f"kiln-prepare-{i}", daemon=True) for i in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> bool:
        """Queue a job; False (and nothing queued) when the queue is full."""
        try:
            self._jobs.put_nowait(job)
            return True
        except queue.Full:
            return False

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
