"""Two ``kiln serve`` on one machine, told only different ports, both serve: each picks its own
private gateway-worker socket instead of a fixed TCP port that the second would collide on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.gateway.test_supervisor import _workers
from tests.support import free_port, wait_until


def _serve(tmp_path: Path, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--engine", "scripted"],
        env=env, stdout=open(tmp_path / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}"


def test_two_servers_with_different_ports_both_serve(tmp_path):
    servers = [_serve(tmp_path, "a"), _serve(tmp_path, "b")]
    try:
        for _, base in servers:
            assert wait_until(lambda base=base: len(_workers(base)) == 1), (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
        for _, base in servers:
            r = httpx.post(base + "/v1/responses", json={"model": "kiln-scripted", "input": "hi", "max_output_tokens": 4}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["output"], r.text
        sockets = {w["tag"] for _, base in servers for w in _workers(base)}
        assert len(sockets) == 2  # each gateway sees only its own worker
    finally:
        for proc, _ in servers:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
