"""Slow and half-open clients against a real ``kiln-gateway`` (Hypercorn) process.

Only the gateway runs (no worker): every case here is decided before a worker would be involved.
Short configured bounds (1 s) and generous socket timeouts on the assertions, so the tests check
what a client sees (a 408, a closed connection, bounded memory), never how long it took.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support import Proc, free_port

WAIT = 30.0  # seconds a socket may wait for the server; the configured bounds are 1 s


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edge")
    port = free_port()
    argv = [
        sys.executable, "-m", "kiln.gateway", "--port", str(port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}",
        "--body-timeout", "1", "--keep-alive-timeout", "1", "--log-level", "warning", "--allow-unauthenticated-workers",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    proc = Proc(argv, env, tmp / "gateway.log").start()
    deadline = time.monotonic() + 60
    while True:
        assert proc.alive(), proc.log()
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # 503 without workers is fine
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"gateway did not answer:\n{proc.log()}") from None
            time.sleep(0.2)
    yield proc, port
    proc.kill()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    s.settimeout(WAIT)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _stalled_post(port: int, declared: int, sent: bytes) -> socket.socket:
    s = _connect(port)
    head = (
        f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    s.sendall(head + sent)
    return s


def test_a_stalled_body_gets_408_and_the_connection_is_closed(gateway):
    _, port = gateway
    with _stalled_post(port, 1000, b'{"model": "x", "in') as s:
        answer = _read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer


def test_a_half_open_client_is_closed_by_the_server(gateway):
    _, port = gateway
    with _connect(port) as s:
        assert _read_until_closed(s) == b""


def test_a_header_dribbling_client_is_closed_by_the_server(gateway):
    _, port = gateway
    with _connect(port) as s:
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finish
        assert _read_until_closed(s) == b""


def test_a_foreign_host_is_403_over_the_wire(gateway):
    _, port = gateway
    r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"host": "rebound.evil.example"}, timeout=WAIT)
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "host_not_allowed"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_forty_stalled_30_mib_bodies_leave_memory_bounded(gateway):
    proc, port = gateway
    before = _rss_kib(proc.process.pid)
    sockets = [_stalled_post(port, 30 << 20, b'{"input": "' + b"x" * 4096) for _ in range(40)]
    try:
        answers = [_read_until_closed(s) for s in sockets]
        during = _rss_kib(proc.process.pid)
    finally:
        for s in sockets:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers)
    # Generous: what matters is that 40 x 30 MiB declared does not become 1.2 GB held.
    assert during - before < 200 * 1024, (before, during)
    print(f"gateway RSS before {before} KiB, after 40 stalled 30 MiB bodies {during} KiB")
