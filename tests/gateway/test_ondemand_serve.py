"""On-demand models with real processes: ``kiln serve --config`` starts and stops workers when its
gateway asks, within the memory budget; a slow load is answered within ``--load-timeout``; a model
that cannot load is a 503, not a dead server; and the two daemons run separately from one file.

The workers here are the scripted engine (named as such: no weights, so each start takes the
process start-up alone) except where the point is a real load failing. The real-model version
(start at the first request, resident memory, stop after the idle time) is in test_multi_model.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conformance import assert_error, assert_model_list
from tests.support import Kiln, free_port, wait_until, worker_pids

LOAD_BOUND_S = 180  # a worker process start on a busy 2-core machine, with room to spare



def _gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class Serve:
    def __init__(self, tmp: Path, config: str, *args: str) -> None:
        self.tmp = tmp
        path = tmp / "kiln.toml"
        path.write_text(config)
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        self.log = tmp / "serve.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}",
             "--config", str(path), "--log-level", "info", *args],
            env=env, stdout=open(tmp / "serve.out", "wb"), stderr=open(self.log, "wb"),
        )  # fmt: skip
        assert wait_until(self.up, 120), self.tail()

    def up(self) -> bool:
        try:
            return httpx.get(self.base + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def workers(self) -> list[dict]:
        try:
            return httpx.get(self.base + "/health", timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError):
            return []

    def pids(self, model: str) -> list[int]:
        return worker_pids(self.proc.pid, model) if any(w["model"] == model for w in self.workers()) else []

    def status(self) -> dict[str, str]:
        listed = httpx.get(self.base + "/v1/models", timeout=5).json()
        assert_model_list(listed)
        return {m["id"]: m["status"] for m in listed["data"]}

    def create(self, model: str, **extra) -> httpx.Response:
        return httpx.post(self.base + "/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 4, **extra}, timeout=LOAD_BOUND_S)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


BUDGET = """
memory_budget = "500MB"

[[models]]
id = "a"
source = "scripted"
load = "on-demand"
idle_stop = "10m"
memory = "300MB"

[[models]]
id = "b"
source = "scripted"
load = "on-demand"
idle_stop = "10m"
memory = "300MB"
"""


def test_the_budget_stops_an_idle_model_for_another_and_refuses_when_all_are_busy(tmp_path):
    serve = Serve(tmp_path, BUDGET, "--engine", "scripted", "--scripted-delay", "0.005", "--scripted-reply", "x" * 3000)
    try:
        assert serve.workers() == [] and serve.status() == {"a": "not_loaded", "b": "not_loaded"}
        r = serve.create("a")
        assert r.status_code == 200, r.text + serve.tail()
        (pid_a,) = serve.pids("a")
        # b does not fit beside a (600 MB of 500): a is idle, so it is stopped first.
        r = serve.create("b")
        assert r.status_code == 200, r.text + serve.tail()
        assert _gone(pid_a), "a's worker must have exited before b started"
        assert serve.status() == {"a": "not_loaded", "b": "loaded"}
        # A long stream keeps b busy: a cannot be given b's memory now.
        first_delta = threading.Event()
        done = threading.Event()

        def hold() -> None:
            body = {"model": "b", "input": "hi", "stream": True}
            with httpx.stream("POST", serve.base + "/v1/responses", json=body, timeout=120) as stream:
                for line in stream.iter_lines():
                    if "output_text.delta" in line:
                        first_delta.set()
                    if done.is_set():
                        return

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert first_delta.wait(60), serve.tail()
        r = serve.create("a")
        done.set()
        assert r.status_code == 503, r.text
        assert_error(r.json())
        assert r.json()["error"]["code"] == "memory_budget_exceeded" and int(r.headers["retry-after"]) > 0
        holder.join(120)
        # b is idle again: now a may have its memory.
        r = serve.create("a")
        assert r.status_code == 200, r.text + serve.tail()
        assert serve.status() == {"a": "loaded", "b": "not_loaded"}
    finally:
        serve.stop()


def test_a_slow_load_is_answered_within_the_load_timeout(tmp_path):
    config = '[[models]]\nid = "slow"\nsource = "scripted"\nload = "on-demand"\n'
    serve = Serve(tmp_path, config, "--engine", "scripted", "--scripted-load-delay", "600", "--load-timeout", "1")
    try:
        started = time.monotonic()
        r = serve.create("slow")
        took = time.monotonic() - started
        assert r.status_code == 503, r.text
        assert_error(r.json())
        assert r.json()["error"]["code"] == "model_loading" and int(r.headers["retry-after"]) > 0
        assert took < 60  # the bound (1 s) plus this machine's noise, far below the load's 600 s
        assert serve.status() == {"slow": "loading"}  # and the load goes on
    finally:
        serve.stop()


def test_a_model_that_cannot_load_is_a_503_and_the_server_stays_up(tmp_path):
    config = f'[[models]]\nid = "broken"\nsource = "{tmp_path}/no-such-model.gguf"\nload = "on-demand"\n'
    serve = Serve(tmp_path, config)
    try:
        r = serve.create("broken")
        assert r.status_code == 503, r.text
        assert_error(r.json())
        assert r.json()["error"]["code"] == "model_load_failed", r.text
        assert "exited with status 2" in r.json()["error"]["message"]
        assert serve.proc.poll() is None and serve.up()
        assert serve.status() == {"broken": "not_loaded"}
        assert "no-such-model.gguf" in serve.tail()  # the worker's own reason, in the log
    finally:
        serve.stop()


def test_the_daemons_run_separately_from_one_config_file(tmp_path):
    config = tmp_path / "kiln.toml"
    config.write_text("""
[[models]]
id = "small"
source = "scripted"
aliases = ["tiny"]
context_length = 2048
max_batch = 2

[[models]]
id = "later"
source = "scripted"
load = "on-demand"
""")
    kiln = Kiln(tmp_path, gateway_args=["--config", str(config)], worker_args=["--engine", "scripted", "--config", str(config), "--model-id", "small"])
    kiln.start(timeout=LOAD_BOUND_S)
    try:
        base = kiln.base_url
        listed = httpx.get(base + "/v1/models", timeout=5).json()
        assert_model_list(listed)
        by_id = {m["id"]: m for m in listed["data"]}
        assert set(by_id) == {"small", "later"}
        assert (by_id["small"]["loaded"], by_id["small"]["context_window"], by_id["small"]["aliases"]) == (True, 2048, ["tiny"])
        assert by_id["later"]["loaded"] is False
        r = httpx.post(base + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "small"
        # A model of the file with no worker is the backend's absence (503), not the client's error.
        later = httpx.post(base + "/v1/responses", json={"model": "later", "input": "hi"}, timeout=60)
        assert later.status_code == 503 and later.json()["error"]["code"] == "model_not_loaded"
        missing = httpx.post(base + "/v1/responses", json={"model": "gpt-4o", "input": "hi"}, timeout=60)
        assert missing.status_code == 404
        # The worker reports its resident memory (what a budget counts for a model without `memory`).
        worker = lambda: httpx.get(base + "/health", timeout=5).json()["workers"][0]  # noqa: E731
        assert wait_until(lambda: worker()["rss_bytes"] > 0, 30)
        with open(f"/proc/{kiln.worker_procs[0].process.pid}/status") as f:
            vm_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        assert 0.5 < worker()["rss_bytes"] / vm_rss < 2
    finally:
        kiln.stop()


def test_worker_config_errors_are_usage_errors(tmp_path):
    config = tmp_path / "kiln.toml"
    config.write_text('[[models]]\nid = "small"\nsource = "scripted"\n')
    cases = [
        (["--config", str(config)], "--config needs --model-id"),
        (["--config", str(config), "--model-id", "other"], "no [[models]] entry has id 'other'"),
        (["--config", str(config), "--model-id", "small", "--model", "x.gguf"], "drop --model"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    for args, message in cases:
        proc = subprocess.run([sys.executable, "-m", "kiln.worker", "--engine", "scripted", *args], capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)


@pytest.mark.parametrize("text", ["{}", '{"t": "StartModel"}', '{"t": "StartModel", "model": 3}', '{"t": "Nope", "model": "a"}', "[1]", "x" * 5000])
def test_control_lines_that_are_not_messages_are_refused(text):
    from kiln.protocol.control import ControlError, decode_line

    with pytest.raises(ControlError):
        decode_line(text.encode())


def test_control_messages_round_trip():
    from kiln.protocol.control import ModelExited, ModelStopped, StartModel, StopModel, decode_line, encode_line

    for message in (StartModel("a"), StopModel("org/name:Q4"), ModelExited("a", -9), ModelStopped("b")):
        line = encode_line(message)
        assert line.endswith(b"\n") and json.loads(line)["t"] == type(message).__name__
        assert decode_line(line) == message
