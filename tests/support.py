"""Starting real Kiln processes on loopback for end-to-end tests."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0, interval: float = 0.2) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds pass (False): a bounded
    wait for what another process does, never a sleep standing in for synchronization."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a Kiln process under test: ours without any KILN_ setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(extra)
    env.setdefault("KILN_LOG_LEVEL", "info")
    return env


@dataclass
class Proc:
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = None

    def start(self) -> Proc:
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.process.send_signal(sig)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@dataclass
class Kiln:
    """A gateway and its workers, each a separate process so tests can kill one."""

    tmp: Path
    gateway_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    workers: int = 1
    env: dict[str, str] = field(default_factory=dict)
    # The worker secret gateway and workers share (CURVE), as `kiln serve` gives its children one;
    # None starts the gateway with --allow-unauthenticated-workers instead.
    secret: str | None = field(default_factory=lambda: secrets.token_urlsafe(24))

    def __post_init__(self) -> None:
        self.secret = self.env.get("KILN_WORKER_SECRET", self.secret)
        self.port = free_port()
        self.zmq = f"tcp://127.0.0.1:{free_port()}"
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self.worker_procs: list[Proc] = []

    def _env(self) -> dict[str, str]:
        return process_env({"KILN_WORKER_SECRET": self.secret, **self.env} if self.secret else self.env)

    def start(self, timeout: float = 180) -> Kiln:
        trust = [] if self.secret else ["--allow-unauthenticated-workers"]
        gw = Proc([sys.executable, "-m", "kiln.gateway", "--port", str(self.port), "--workers-bind", self.zmq, "--heartbeat-timeout", "3", *trust, *self.gateway_args], self._env(),
            self.tmp / "gateway.log")
        self.gateway = gw.start()
        self.procs.append(gw)
        for _ in range(self.workers):
            self.add_worker()
        try:
            self.wait_ready(timeout, self.workers)
        except BaseException:
            self.stop()  # a fixture that fails here never reaches its own cleanup
            raise
        return self

    def add_worker(self, extra: list[str] | None = None) -> Proc:
        n = len(self.worker_procs)
        wk = Proc([sys.executable, "-m", "kiln.worker", "--gateway", self.zmq, *self.worker_args, *(extra or [])], self._env(), self.tmp / f"worker{n}.log")
        wk.start()
        self.procs.append(wk)
        self.worker_procs.append(wk)
        return wk

    def wait_ready(self, timeout: float, workers: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.process.poll() is not None and p is self.gateway:
                    raise RuntimeError(f"gateway exited:\n{p.log()}")
            try:
                r = httpx.get(self.base_url + "/health", timeout=2)
                if len(r.json()["workers"]) >= workers:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        logs = "\n".join(p.log() for p in self.procs)
        raise RuntimeError(f"Kiln did not become ready in {timeout}s:\n{logs}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.kill(signal.SIGTERM)


def sse_events(response: httpx.Response) -> tuple[list[str], list[dict]]:
    """(event names, data payloads) of an SSE response."""
    names, events = [], []
    for line in response.iter_lines():
        if line.startswith("event: "):
            names.append(line[len("event: "):])
        elif line.startswith("data: "):
            events.append(json.loads(line[len("data: "):]))
    return names, events


def stream(client: httpx.Client, body: dict) -> tuple[list[str], list[dict]]:
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r)


def worker_pids(root: int, model: str) -> list[int]:
    """The pids of ``kiln.worker`` processes under ``root`` (a `kiln serve`) started with
    ``--model-id MODEL`` (/health names no pid: it is open to anyone)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == root and b"kiln.worker" in argv and any(a == b"--model-id" and b == model.encode() for a, b in zip(argv, argv[1:], strict=False)):
            found.append(int(entry))
    return found
