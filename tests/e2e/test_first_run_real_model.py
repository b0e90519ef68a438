"""A new user's first run: ``kiln serve`` with the real bundled model, every door polled from the
moment the process starts.

Until the model is loaded every answer is 503 with Retry-After and the loading code, in each API's
own error shape (never 404 model_not_found); ``/health`` says ``ready: false`` meanwhile; the console
(stdout, read as the user sees it) shows the model load and prints its "ready — try: curl" line
only once a request is served: every request sent after that line succeeds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import websockets.sync.client

from tests.support import free_port

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
USER = [{"role": "user", "content": "Say hi."}]


@dataclass
class Serve:
    """A ``kiln serve`` process whose stdout (the console) is read line by line as it comes."""

    process: subprocess.Popen
    base: str
    stderr_path: Path
    lines: list[tuple[float, str]] = field(default_factory=list)

    def read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

    def ready_at(self) -> float | None:
        return next((t for t, line in self.lines if line.startswith("kiln: ready")), None)

    def console(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def start_serve(tmp: Path, *args: str, name: str = "serve") -> Serve:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--port", str(port), *args],
        env=env, stdout=subprocess.PIPE, stderr=open(tmp / f"{name}.err", "wb"),
    )  # fmt: skip
    serve = Serve(process, f"http://127.0.0.1:{port}", tmp / f"{name}.err")
    threading.Thread(target=serve.read, daemon=True).start()
    return serve


@dataclass
class Answer:
    door: str
    sent: float
    status: int  # 0: no HTTP answer yet (the gateway is not listening)
    loading: bool = False  # 503, Retry-After, and the loading code in the door's own shape
    detail: str = ""


def _openai_loading(r: httpx.Response) -> bool:
    error = r.json().get("error") or {}
    return r.status_code == 503 and int(r.headers.get("retry-after", "0")) > 0 and error.get("code") == "model_loading" and error.get("type") == "server_error"


def _anthropic_loading(r: httpx.Response) -> bool:
    body = r.json()
    return (
        r.status_code == 503 and int(r.headers.get("retry-after", "0")) > 0 and body.get("type") == "error"
        and body["error"].get("type") == "overloaded_error" and "loading" in body["error"].get("message", "")
    )  # fmt: skip


def http_doors(model: str) -> dict[str, tuple[str, dict, Callable[[httpx.Response], bool]]]:
    """Each HTTP door: its path, a small request for ``model``, and how its loading answer looks."""
    return {
        "responses": ("/v1/responses", {"model": model, "input": "Say hi.", "max_output_tokens": 2}, _openai_loading),
        "responses.input_tokens": ("/v1/responses/input_tokens", {"model": model, "input": "Say hi."}, _openai_loading),
        "chat.completions": ("/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 2}, _openai_loading),
        "completions": ("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2}, _openai_loading),
        "messages": ("/v1/messages", {"model": model, "messages": USER, "max_tokens": 2}, _anthropic_loading),
        "messages.count_tokens": ("/v1/messages/count_tokens", {"model": model, "messages": USER}, _anthropic_loading),
    }


def ask_http(client: httpx.Client, door: str, path: str, body: dict, loading: Callable[[httpx.Response], bool]) -> Answer:
    sent = time.monotonic()
    try:
        r = client.post(path, json=body)
    except httpx.TransportError as exc:
        return Answer(door, sent, 0, detail=type(exc).__name__)
    return Answer(door, sent, r.status_code, loading=r.status_code == 503 and loading(r), detail=r.text[:300])


def ask_websocket(base: str, model: str) -> Answer:
    """One turn in WebSocket mode: its first frame is the turn's start, or an error frame."""
    sent = time.monotonic()
    url = base.replace("http://", "ws://") + "/v1/responses"
    try:
        with websockets.sync.client.connect(url, open_timeout=10, close_timeout=2) as ws:
            ws.send(json.dumps({"type": "response.create", "model": model, "input": "Say hi.", "max_output_tokens": 2}))
            while True:
                frame = json.loads(ws.recv(timeout=120))
                if frame["type"] == "error":
                    error = frame["error"]
                    is_loading = frame.get("status") == 503 and error.get("code") == "model_loading"
                    return Answer("websocket", sent, frame.get("status", 0), loading=is_loading, detail=json.dumps(frame)[:300])
                if frame["type"] in ("response.completed", "response.incomplete"):
                    return Answer("websocket", sent, 200)
                if frame["type"] == "response.failed":
                    return Answer("websocket", sent, 500, detail=json.dumps(frame)[:300])
    except (OSError, websockets.exceptions.WebSocketException) as exc:
        return Answer("websocket", sent, 0, detail=type(exc).__name__)


def poll_every_door(serve: Serve, model: str, timeout: float) -> list[Answer]:
    """Ask every door again and again from the start until each has been asked once after the
    ready line came out, or ``timeout`` passes."""
    answers: list[Answer] = []
    doors = http_doors(model)
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=serve.base, timeout=120) as client:
        while time.monotonic() < deadline and serve.process.poll() is None:
            for door, (path, body, loading) in doors.items():
                answers.append(ask_http(client, door, path, body, loading))
            answers.append(ask_websocket(serve.base, model))
            ready = serve.ready_at()
            after = {a.door for a in answers if ready is not None and a.sent >= ready}
            if after == {*doors, "websocket"}:  # each door asked once more after the ready line
                break
            time.sleep(0.3)
    return answers


def check_first_run(serve: Serve, answers: list[Answer]) -> None:
    """What a user polling from the start must see (the assertions of the first-run tests)."""
    console = serve.console()
    ready = serve.ready_at()
    assert ready is not None, f"no ready line:\n{console}\n{serve.stderr_path.read_text()[-3000:]}"
    assert not [a for a in answers if a.status == 404], "a 404 while the model loads"
    answered = [a for a in answers if a.status != 0]  # 0: before the gateway listens
    wrong = [a for a in answered if a.status != 200 and not a.loading]
    assert not wrong, f"answers other than 200 or 503 model_loading: {wrong[:3]}"
    assert any(a.loading for a in answered), "no door answered 503 model_loading: the test saw no loading"
    for door in {a.door for a in answers}:
        assert any(a.status == 200 for a in answers if a.door == door), f"{door} was never served"
    after = [a for a in answers if a.sent >= ready]
    assert after and all(a.status == 200 for a in after), f"the ready line came before requests were served: {[a for a in after if a.status != 200][:3]}"
    lines = console.splitlines()
    assert lines[0].startswith("kiln: starting on ") and "model_loading" in lines[0]
    assert lines[-1].startswith("kiln: ready in ") and f'"model": "{serve_model(lines[-1])}"' in lines[-1] and "try: curl " in lines[-1]


def serve_model(ready_line: str) -> str:
    return json.loads(ready_line.split(" -d '", 1)[1].rstrip("'"))["model"]


def test_first_run_answers_loading_then_ready(tmp_path):
    serve = start_serve(tmp_path, "--data-dir", str(tmp_path / "data"))
    try:
        loading_health: list[dict] = []

        def health() -> None:  # /health while the model loads: up or not, never "ready"
            while serve.ready_at() is None and serve.process.poll() is None:
                try:
                    loading_health.append(httpx.get(serve.base + "/health", timeout=5).json())
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)  # the bundled model maps its kept panels: its load can take under a second

        watcher = threading.Thread(target=health, daemon=True)
        watcher.start()
        answers = poll_every_door(serve, MODEL, timeout=600)
        watcher.join(10)
        check_first_run(serve, answers)
        assert serve_model(serve.console().splitlines()[-1]) == MODEL
        # The console shows the model load (its file and size) from the worker, before "ready".
        assert "kiln: worker-0: loading model smollm2-135m-instruct from " in serve.console() and " MB, " in serve.console()
        assert "kiln: worker-0: loaded model smollm2-135m-instruct" in serve.console()
        assert any(h["ready"] is False and h["loading"] == [MODEL] for h in loading_health), loading_health[:3]
        done = httpx.get(serve.base + "/health", timeout=5).json()
        assert done["ready"] is True and done["loading"] == [] and done["status"] == "ok"
        # Unknown models stay 404 on every door.
        with httpx.Client(base_url=serve.base, timeout=30) as client:
            for door, (path, body, _) in http_doors("no-such-model").items():
                assert client.post(path, json=body).status_code == 404, door
        # The JSON log stays JSON (and quiet): the console lines went to stdout only.
        for line in serve.stderr_path.read_text().splitlines():
            json.loads(line)
    finally:
        assert serve.stop() == 0
