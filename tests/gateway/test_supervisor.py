"""``kiln serve``: one gateway and N workers; a dead worker comes back; SIGTERM stops all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx

from tests.support import free_port, wait_until


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _workers(base: str) -> list[dict]:
    try:
        return httpx.get(base + "/health", timeout=2).json()["workers"]
    except (httpx.HTTPError, ValueError):
        return []



def test_serve_restarts_workers_and_stops_cleanly(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}", "--workers", "2", "--engine", "scripted"],
        env=env, stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT,
    )
    try:
        assert wait_until(lambda: len(_workers(base)) == 2), (tmp_path / "serve.log").read_text()
        children = _children(proc.pid)
        assert len(children) == 3  # gateway + 2 workers
        before = {w["tag"] for w in _workers(base)}
        worker_pids = [c for c in children if b"kiln.worker" in open(f"/proc/{c}/cmdline", "rb").read()]
        os.kill(worker_pids[0], signal.SIGKILL)
        # The supervisor starts a replacement, which registers under a new id.
        assert wait_until(lambda: len({w["tag"] for w in _workers(base)} - before) == 1 and len(_workers(base)) == 2, 90)
        r = httpx.post(base + "/v1/responses", json={"model": "kiln-scripted", "input": "hi", "max_output_tokens": 3}, timeout=30)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert wait_until(lambda: all(not os.path.exists(f"/proc/{c}") or open(f"/proc/{c}/stat").read().split()[2] == "Z" for c in children), 20)
    finally:
        if proc.poll() is None:
            proc.kill()


def _serve(tmp_path, *args: str, workers: int = 1, log: str = "serve.log") -> tuple[subprocess.Popen, str, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}", "--workers", str(workers), *args],
        env=env, stdout=open(tmp_path / (log + ".out"), "wb"), stderr=open(tmp_path / log, "wb"),
    )
    return proc, f"http://127.0.0.1:{port}", port


def _gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except FileNotFoundError:
        return b""


def test_serve_restarts_a_dead_gateway(tmp_path):
    proc, base, _ = _serve(tmp_path, "--engine", "scripted")
    try:
        assert wait_until(lambda: len(_workers(base)) == 1), (tmp_path / "serve.log").read_text()
        gateway = [c for c in _children(proc.pid) if b"kiln.gateway" in _cmdline(c)]
        assert len(gateway) == 1
        os.kill(gateway[0], signal.SIGKILL)
        # A new gateway process comes up on the same port and the worker registers with it again.
        assert wait_until(lambda: len(_workers(base)) == 1 and gateway[0] not in _children(proc.pid), 90), (tmp_path / "serve.log").read_text()
        r = httpx.post(base + "/v1/responses", json={"model": "kiln-scripted", "input": "hi", "max_output_tokens": 3}, timeout=30)
        assert r.status_code == 200
        assert proc.poll() is None
        warnings = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if line.strip()]
        assert any(e["msg"] == "gateway exited; restarting" for e in warnings)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_serve_leaves_no_orphans(tmp_path):
    proc, base, port = _serve(tmp_path, "--engine", "scripted", workers=2)
    children: list[int] = []
    try:
        assert wait_until(lambda: len(_workers(base)) == 2), (tmp_path / "serve.log").read_text()
        children = _children(proc.pid)
        assert len(children) == 3
        proc.kill()  # SIGKILL: no chance to stop its children itself
        proc.wait(10)
        assert wait_until(lambda: all(_gone(c) for c in children), 30), [c for c in children if not _gone(c)]
        assert wait_until(lambda: _port_free(port), 10)
    finally:
        for c in children:
            if not _gone(c) and (b"kiln.worker" in _cmdline(c) or b"kiln.gateway" in _cmdline(c)):
                os.kill(c, signal.SIGKILL)


def test_serve_fails_at_start_when_the_model_cannot_load(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    proc, base, port = _serve(tmp_path, "--model", str(missing))
    try:
        code = proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("kiln serve kept restarting a worker whose model cannot load:\n" + (tmp_path / "serve.log").read_text()[-3000:]) from None
    log_text = (tmp_path / "serve.log").read_text()
    assert code != 0, log_text
    entries = [json.loads(line) for line in log_text.splitlines() if line.strip()]
    assert any(e["logger"] == "kiln.supervisor" and e["msg"] == "worker exited during start; stopping" for e in entries), log_text
    assert not any(e["msg"] == "worker exited; restarting" for e in entries)
    # The worker's own error, as one JSON line, says why.
    assert any(e["level"] in ("error", "critical") and "model not found" in e.get("exc", "") + e["msg"] for e in entries), log_text
    assert wait_until(lambda: _port_free(port), 10)


def test_serve_fails_at_start_when_the_gateway_cannot_bind(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}", "--engine", "scripted"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "wb"),
        )
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("kiln serve did not give up on a gateway that cannot bind") from None
    entries = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if line.strip()]
    assert code != 0
    assert any(e["msg"] == "gateway exited during start; stopping" for e in entries), entries
