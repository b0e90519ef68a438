"""``kiln serve``: one gateway and N workers as child processes.

The supervisor restarts a worker that exits (with a short backoff so a model that cannot load
does not spin), and on SIGINT/SIGTERM stops the workers and the gateway, escalating to SIGKILL
for any child that outlives the grace period.
"""

from __future__ import annotations

import logging

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("kiln.supervisor")


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, start_new_session=False)
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Supervisor:
    gateway: Child
    workers: list[Child] = field(default_factory=list)
    grace_s: float = 10.0
    _stopping: bool = False

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request_stop)
        self.gateway.start()
        for worker in self.workers:
            worker.start()
        try:
            while not self._stopping:
                if not self.gateway.alive():
                    log.error("gateway exited", extra={"code": self.gateway.process.returncode})
                    return self.gateway.process.returncode or 1
                self._tend_workers()
                time.sleep(0.2)
        finally:
            self._stop_all()
        return 0

    def _tend_workers(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            if worker.alive():
                continue
            if worker.next_start == 0.0:
                # Back off longer when a worker dies soon after starting (e.g. a model that won't load).
                quick = now - worker.started_at < 30
                delay = min(30.0, 0.5 * (2 ** min(worker.restarts, 6))) if quick else 0.5
                worker.next_start = now + delay
                code = worker.process.returncode if worker.process else None
                log.warning("worker exited; restarting", extra={"worker": worker.name, "code": code, "in_s": delay})
            elif now >= worker.next_start:
                worker.restarts += 1
                worker.next_start = 0.0
                worker.start()

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _stop_all(self) -> None:
        children = [c for c in [*self.workers, self.gateway] if c.alive()]
        for child in children:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in children:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def build(*, gateway_args: list[str], worker_args: list[str], workers: int) -> Supervisor:
    python = sys.executable
    gateway = Child("gateway", [python, "-m", "kiln.gateway", *gateway_args])
    children = [Child(f"worker-{i}", [python, "-m", "kiln.worker", *worker_args]) for i in range(workers)]
    return Supervisor(gateway, children)


