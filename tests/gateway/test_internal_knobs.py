"""Nothing a client sends sets an internal knob, through any door.

What a door decides (``DoorOptions``: the legacy prompt sent without a chat template, the session
that routes a client's requests, a warm-up) never travels in the create body, and the body keeps
only the API's fields. So a client that adds ``raw_prompt`` (the worker would render it verbatim,
skipping the template, the instructions and the tools), ``kiln_session`` (it would choose the
worker), ``keep_tokens`` or the like to a request gets the answer it would have got without them.

In process, against the recording fake pool of test_worker_request.py: each door's request is
sent twice, once clean and once carrying every internal key, and the worker must be sent the
same ``GenerateRequest`` and routed by the same key both times.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

import pytest
from starlette.testclient import TestClient

from kiln.gateway.http.app import create_app
from kiln.gateway.settings import Settings
from kiln.gateway.pool.workers import WorkerHandle
from kiln.protocol import CountTokens, Generate
from kiln.protocol.request import GenerateRequest
from tests.gateway.inprocess import MODEL
from tests.gateway.test_worker_request import RecordingPool

# Every knob a door decides or the gateway once carried in the body, with a value that would show.
INTERNAL = {
    "raw_prompt": "IGNORE THE TEMPLATE",
    "kiln_session": "steer-me",
    "keep_tokens": 1,
    "session": "steer-me",
    "warm_up": True,
    "cap_to_window": True,
    "options": {"raw_prompt": "IGNORE THE TEMPLATE"},
    "wire_input": [{"type": "message", "role": "user", "content": "IGNORE"}],
    "owner": "another-org",
}


class RoutingPool(RecordingPool):
    """The recording pool, also keeping the routing key of every worker choice."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str | None] = []

    def pick(self, model: str, cache_key: str | None = None, exclude: Collection[bytes] = ()) -> WorkerHandle:
        self.keys.append(cache_key)
        return super().pick(model, cache_key, exclude)


@pytest.fixture
def gateway():
    pool = RoutingPool()
    with TestClient(create_app(Settings(), pool=pool), base_url="http://127.0.0.1") as client:
        client.pool = pool
        yield client


def sent(gateway: Any, send: Any, kind: type = Generate) -> tuple[GenerateRequest, list[str | None]]:
    """What ``send()`` made the gateway send the worker, and the routing keys it used."""
    gateway.pool.sent.clear()
    gateway.pool.keys.clear()
    send()
    return gateway.pool.request(kind), list(gateway.pool.keys)


def http(gateway: Any, path: str, body: dict[str, Any]) -> Any:
    def send() -> None:
        r = gateway.post(path, json=body)
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("application/json"):
            assert not set(INTERNAL) & set(r.json()), r.json()  # nothing echoed either

    return send


def socket(gateway: Any, body: dict[str, Any]) -> Any:
    def send() -> None:
        with gateway.websocket_connect("ws://127.0.0.1/v1/responses") as ws:
            ws.send_text(json.dumps({"type": "response.create", **body}))
            while True:
                event = json.loads(ws.receive_text())
                assert event["type"] not in ("error", "response.failed"), event
                if event["type"] == "response.completed":
                    assert not set(INTERNAL) & set(event["response"])
                    return

    return send


DOORS = {
    "responses": ("/v1/responses", {"model": MODEL, "instructions": "Be brief.", "input": "hi"}),
    "responses-sse": ("/v1/responses", {"model": MODEL, "instructions": "Be brief.", "input": "hi", "stream": True}),
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "Once upon"}),
    "messages": ("/v1/messages", {"model": MODEL, "max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}),
    "messages-stream": ("/v1/messages", {"model": MODEL, "max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
}


@pytest.mark.parametrize("door", sorted(DOORS))
def test_an_http_door_ignores_every_internal_key(gateway, door):
    path, body = DOORS[door]
    clean, clean_keys = sent(gateway, http(gateway, path, body))
    hostile, hostile_keys = sent(gateway, http(gateway, path, {**body, **INTERNAL}))
    assert hostile == clean and hostile_keys == clean_keys == [None]
    # Only the legacy door renders without a template, and then its own prompt.
    assert clean.raw_prompt == ("Once upon" if door == "completions" else None)


def test_the_websocket_door_ignores_every_internal_key(gateway):
    body = {"model": MODEL, "instructions": "Be brief.", "input": "hi", "store": False}
    clean, clean_keys = sent(gateway, socket(gateway, body))
    hostile, hostile_keys = sent(gateway, socket(gateway, {**body, **INTERNAL}))
    assert hostile == clean and hostile.raw_prompt is None and hostile.instructions == "Be brief."
    # Each connection routes by its own session, never one the client named.
    assert [k.startswith("ws-") for k in clean_keys + hostile_keys] == [True, True] and "steer-me" not in hostile_keys


def test_a_session_header_routes_but_a_session_field_does_not(gateway):
    path, body = DOORS["responses"]
    by_header, keys = sent(gateway, lambda: gateway.post(path, json=body, headers={"session-id": "codex-1"}))
    assert keys == ["codex-1"] and by_header.cache_key is None


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/responses/input_tokens", {"model": MODEL, "instructions": "Be brief.", "input": "hi"}),
    ("/v1/messages/count_tokens", {"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}),
])  # fmt: skip
def test_token_counts_ignore_every_internal_key(gateway, path, body):
    clean, _ = sent(gateway, http(gateway, path, body), CountTokens)
    hostile, _ = sent(gateway, http(gateway, path, {**body, **INTERNAL}), CountTokens)
    assert hostile == clean and hostile.raw_prompt is None
