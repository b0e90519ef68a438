"""The captured Codex CLI 0.169 request (tests/data/codex-0.169-request.json) against Kiln.

Every field Codex sends must be accepted. The capture is ~8.8k tokens with SmolLM2's tokenizer,
more than the bundled model's 8192-token window, so the real-model replay shortens the long
developer text and keeps every field and tool shape."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest

from tests.conformance import assert_error, assert_stream
from tests.support import Kiln, sse_events

CAPTURE = json.loads((Path(__file__).parents[1] / "data" / "codex-0.169-request.json").read_text())
HEADERS = {k: v for k, v in CAPTURE["headers"].items() if k not in ("content-length", "authorization", "accept")}


def _body(model: str) -> dict:
    body = copy.deepcopy(CAPTURE["body"])
    body["model"] = model
    return body


def _shortened(body: dict) -> dict:
    for item in body["input"]:
        if item.get("role") == "developer":
            for part in item["content"]:
                part["text"] = part["text"][:400]
    for tool in body["tools"]:
        if "description" in tool:
            tool["description"] = tool["description"][:200]
    return body


def _stream(client: httpx.Client, body: dict) -> tuple[list[str], list[dict]]:
    with client.stream("POST", "/v1/responses", json=body, headers=HEADERS) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r)


def test_web_search_is_refused_by_default(http):
    r = http.post("/v1/responses", json=_body("smollm2-135m-instruct"), headers=HEADERS)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools[")
    assert_error(r.json())


def test_replay_is_a_well_formed_stream(http):
    body = _shortened(_body("smollm2-135m-instruct"))
    body["tools"] = [t for t in body["tools"] if t["type"] != "web_search"]
    body["max_output_tokens"] = 48
    names, events = _stream(http, body)
    assert_stream(events, names)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


@pytest.fixture(scope="module")
def dropping(tmp_path_factory):
    server = Kiln(tmp_path_factory.mktemp("codexdrop"), gateway_args=["--hosted-tools", "drop"], worker_args=["--engine", "scripted"]).start(timeout=60)
    yield server
    server.stop()


def test_untouched_capture_with_hosted_tools_dropped(dropping):
    """The whole capture, unmodified: accepted; it does not fit the window, which a streaming
    client hears in-stream as context_length_exceeded (Codex then compacts)."""
    with httpx.Client(base_url=dropping.base_url, timeout=60) as client:
        names, events = _stream(client, _body("kiln-scripted"))
        assert_stream(events, names)
        assert events[-1]["type"] == "response.failed"
        assert events[-1]["response"]["error"]["code"] == "context_length_exceeded"
        small = _shortened(_body("kiln-scripted"))
        small["input"] = small["input"][:1] + small["input"][-1:]
        small["input"][0]["content"][0]["text"] = "Be brief."
        small["tools"] = [t for t in small["tools"] if t["type"] in ("namespace", "web_search")]
        small["tools"][0]["tools"] = small["tools"][0]["tools"][:2]  # byte tokens: keep it inside the window
        names, events = _stream(client, small)
        assert_stream(events, names)
        assert events[-1]["type"] == "response.completed", events[-1]["response"].get("error")
