"""Several gateway replicas and workers connected to all of them, as real processes on loopback.

``Replicas`` is ``tests.support.Kiln`` for a scaled-out deployment: each gateway has its own HTTP
port and worker socket, every worker gets one ``--gateway`` per replica, and a test can kill a
gateway and start it again on the same addresses.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .support import Proc, free_port, process_env


@dataclass
class Replicas:
    tmp: Path
    gateways: int = 2
    workers: int = 1
    gateway_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Where the gateways bind their worker sockets (a veth address when workers live in another
    # network namespace), and what runs the workers (e.g. ``ip netns exec NAME``).
    workers_host: str = "127.0.0.1"
    worker_prefix: list[str] = field(default_factory=list)
    heartbeat_timeout_s: float = 3.0
    # A Redis URL: the gateways advertise their worker sockets there and the workers discover
    # them (no --gateway list). Set KILN_REDIS_NAMESPACE in ``env`` to keep tests apart.
    discover: str | None = None

    def __post_init__(self) -> None:
        self.ports = [free_port() for _ in range(self.gateways)]
        self.zmq = [f"tcp://{self.workers_host}:{free_port()}" for _ in range(self.gateways)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.gateway_procs: list[Proc | None] = [None] * self.gateways
        self.worker_procs: list[Proc] = []
        self._starts = 0

    def _env(self) -> dict[str, str]:
        return process_env(self.env)

    def start(self, timeout: float = 120) -> "Replicas":
        try:
            for i in range(self.gateways):
                self.start_gateway(i)
            for _ in range(self.workers):
                self.add_worker()
            self.wait_ready(timeout, self.workers)
        except BaseException:
            self.stop()  # a fixture that fails here never reaches its own cleanup
            raise
        return self

    def start_gateway(self, i: int) -> Proc:
        """Start gateway ``i`` (again, after a kill) on its own HTTP port and worker socket."""
        self._starts += 1
        argv = [sys.executable, "-m", "kiln.gateway", "--port", str(self.ports[i]), "--workers-bind", self.zmq[i], "--heartbeat-timeout", str(self.heartbeat_timeout_s), *self.gateway_args]
        if self.discover:
            argv += ["--redis-url", self.discover, "--advertise-workers", self.zmq[i]]
        proc = Proc(argv, self._env(), self.tmp / f"gateway{i}-{self._starts}.log").start()
        self.gateway_procs[i] = proc
        return proc

    def kill_gateway(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.gateway_procs[i]
        if proc is not None:
            proc.kill(sig)

    def add_worker(self, extra: list[str] | None = None) -> Proc:
        n = len(self.worker_procs)
        gateways = ["--discover-redis", self.discover] if self.discover else [arg for address in self.zmq for arg in ("--gateway", address)]
        argv = [*self.worker_prefix, sys.executable, "-m", "kiln.worker", *gateways, *self.worker_args, *(extra or [])]
        proc = Proc(argv, self._env(), self.tmp / f"worker{n}.log").start()
        self.worker_procs.append(proc)
        return proc

    def health(self, i: int) -> dict:
        return httpx.get(self.urls[i] + "/health", timeout=5).json()

    def worker_ids(self, i: int) -> list[str]:
        return sorted(w["id"] for w in self.health(i)["workers"])

    def wait_ready(self, timeout: float, workers: int = 1, gateways: list[int] | None = None) -> None:
        """Until each gateway (of ``gateways``, default all) lists ``workers`` workers."""
        deadline = time.monotonic() + timeout
        pending = set(range(self.gateways) if gateways is None else gateways)
        while pending and time.monotonic() < deadline:
            for i in list(pending):
                proc = self.gateway_procs[i]
                if proc is not None and not proc.alive():
                    raise RuntimeError(f"gateway {i} exited:\n{proc.log()}")
                try:
                    if len(self.health(i)["workers"]) >= workers:
                        pending.discard(i)
                except (httpx.HTTPError, ValueError):
                    pass
            time.sleep(0.2)
        if pending:
            logs = "\n".join(p.log() for p in self.procs())
            raise RuntimeError(f"gateways {sorted(pending)} did not see {workers} workers in {timeout}s:\n{logs}")

    def procs(self) -> list[Proc]:
        return [p for p in self.gateway_procs if p is not None] + self.worker_procs

    def stop(self) -> None:
        for proc in reversed(self.procs()):
            proc.kill(signal.SIGTERM)
