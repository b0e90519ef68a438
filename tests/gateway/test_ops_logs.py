"""Logs are one JSON object per line, quiet by default, and each server error is logged once.

The gateway runs as a real process; a test-only route that raises stands in for a server error
(the launcher below patches ``create_app``, as ``kiln.gateway.http.request_log`` does), so the test does
not depend on some request happening to crash the gateway.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import httpx

from kiln.protocol.logs import JsonFormatter, MAX_TRACEBACK_CHARS
from tests.support import Proc, free_port

LAUNCHER = '''
import sys
from starlette.routing import Route
from kiln.gateway.http import app as app_module
from kiln.gateway.cli import main

create_app = app_module.create_app

async def boom(request):
    raise RuntimeError("injected failure for the log test")

def create_app_with_boom(*args, **kwargs):
    app = create_app(*args, **kwargs)
    app.router.routes.insert(0, Route("/boom", boom))
    return app

app_module.create_app = create_app_with_boom
main()
'''

BAD_REQUESTS = [
    {"content": b"{not json", "headers": {"content-type": "application/json"}},
    {"json": {"model": "no-such-model", "input": "hi"}},
    {"json": {"model": "kiln-scripted", "input": "hi", "temperature": "hot"}},
    {"json": [1, 2, 3]},
]


def _start(tmp_path, level: str) -> tuple[Proc, str]:
    launcher = tmp_path / "launch_gateway.py"
    launcher.write_text(LAUNCHER)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["KILN_LOG_LEVEL"] = level
    argv = [sys.executable, str(launcher), "--port", str(port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}", "--allow-unauthenticated-workers"]
    proc = Proc(argv, env, tmp_path / f"gateway-{level}.log").start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.alive():
        try:
            httpx.get(base + "/health", timeout=2)
            return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"gateway did not start:\n{proc.log()}")


def _lines(proc: Proc) -> list[dict]:
    text = proc.log_path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON log line: {line[:300]!r}")
    return parsed


def _hammer(base: str, bad: int, errors: int) -> None:
    with httpx.Client(base_url=base, timeout=30) as c:
        for i in range(bad):
            r = c.post("/v1/responses", **BAD_REQUESTS[i % len(BAD_REQUESTS)])
            assert 400 <= r.status_code < 500, r.text
        for _ in range(errors):
            r = c.get("/boom")
            assert r.status_code == 500
            assert "injected" not in r.text  # no exception text to the client


def test_default_level_logs_one_json_line_per_server_error_and_nothing_for_4xx(tmp_path):
    proc, base = _start(tmp_path, "warning")
    try:
        _hammer(base, bad=200, errors=3)
    finally:
        proc.kill(15)
    entries = _lines(proc)
    failures = [e for e in entries if e.get("exc_type") == "RuntimeError"]
    assert len(failures) == 3, entries  # each exception once, not once per handler
    assert "injected failure" in failures[0]["exc"] and "Traceback" in failures[0]["exc"]
    assert all("exc" not in e and e["exc_repeats"] >= 1 for e in failures[1:])  # repeats are compact
    assert len(entries) == 3, entries  # the 200 client errors wrote nothing
    assert proc.log_path.stat().st_size < 32 * 1024


def test_info_level_stays_json_and_small(tmp_path):
    proc, base = _start(tmp_path, "info")
    try:
        _hammer(base, bad=200, errors=1)
    finally:
        proc.kill(15)
    entries = _lines(proc)
    assert len(entries) <= 200 + 20, len(entries)  # at most about one line per request
    assert sum(1 for e in entries if e.get("exc_type") == "RuntimeError") == 1
    assert proc.log_path.stat().st_size < 200 * 1024


def test_formatter_bounds_a_huge_traceback():
    def recurse(n: int) -> None:
        if n == 0:
            raise ValueError("x" * 100_000)
        recurse(n - 1)

    try:
        recurse(50)
    except ValueError:
        record = logging.LogRecord("t", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    line = JsonFormatter().format(record)
    entry = json.loads(line)
    assert entry["exc_type"] == "ValueError" and entry["msg"] == "failed"
    assert len(entry["exc"]) <= MAX_TRACEBACK_CHARS + 100
    assert entry["exc"].rstrip().endswith("x")  # the tail, naming the exception, is kept
