"""``kiln serve``: one gateway and N workers; a dead worker comes back; SIGTERM stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.support import free_port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _workers(base: str) -> list[dict]:
    try:
        return httpx.get(base + "/health", timeout=2).json()["workers"]
    except (httpx.HTTPError, ValueError):
        return []


def _wait(predicate, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_serve_restarts_workers_and_stops_cleanly(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}", "--workers", "2", "--engine", "scripted"],
        env=env, stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT,
    )
    try:
        assert _wait(lambda: len(_workers(base)) == 2), (tmp_path / "serve.log").read_text()
        children = _children(proc.pid)
        assert len(children) == 3  # gateway + 2 workers
        before = {w["id"] for w in _workers(base)}
        worker_pids = [c for c in children if b"kiln.worker" in open(f"/proc/{c}/cmdline", "rb").read()]
        os.kill(worker_pids[0], signal.SIGKILL)
        # The supervisor starts a replacement, which registers under a new id.
        assert _wait(lambda: len({w["id"] for w in _workers(base)} - before) == 1 and len(_workers(base)) == 2, 90)
        r = httpx.post(base + "/v1/responses", json={"model": "kiln-scripted", "input": "hi", "max_output_tokens": 3}, timeout=30)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert _wait(lambda: all(not os.path.exists(f"/proc/{c}") or open(f"/proc/{c}/stat").read().split()[2] == "Z" for c in children), 20)
    finally:
        if proc.poll() is None:
            proc.kill()
