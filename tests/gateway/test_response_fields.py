"""Every Response object carries the fields stricter schemas require (issue 15, point 0): on
plain, streamed (each snapshot) and background responses, with null ``usage``/``completed_at``
while in progress, and ``background`` only on background responses (the spec's one difference).

In-process app with the fake worker: these are the gateway's own fields, no model involved.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conformance import assert_api_object, assert_error, assert_response, assert_stream
from tests.gateway.inprocess import MODEL, bounded, client_for, local_app

FIELDS = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "service_tier": "default",
    "max_tool_calls": None,
    "safety_identifier": None,
    "top_logprobs": 0,
}


def _has_point0_fields(obj: dict, **expected) -> None:
    for key, default in {**FIELDS, **expected}.items():
        assert key in obj, f"{key} missing: {obj}"
        assert obj[key] == default, (key, obj[key])
    assert "usage" in obj and "completed_at" in obj
    assert isinstance(obj["top_logprobs"], int)


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture
def app():
    app, _ = local_app()
    return app


async def test_plain_response_has_every_field(app):
    async with client_for(app) as c:
        r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi"}))
    assert r.status_code == 200, r.text
    body = r.json()
    _has_point0_fields(body)
    assert body["completed_at"] is not None and body["usage"] is not None
    assert "background" not in body  # foreground responses carry no such key (spec)
    assert_response(body)
    assert_api_object("Response", body)


async def test_echo_background_puts_false_on_every_foreground_snapshot():
    """--echo-background: for clients holding every Response to OpenAI's schema (which requires
    the key), foreground responses say background: false, on every snapshot and on retrieval."""
    app, _ = local_app(echo_background=True)
    async with client_for(app) as c:
        plain = (await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi"}))).json()
        streamed = _sse((await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}))).text)
        stored = (await bounded(c.get(f"/v1/responses/{plain['id']}"))).json()
    assert plain["background"] is False and stored["background"] is False
    assert_response(plain)
    snapshots = [e["response"] for e in streamed if "response" in e]
    assert snapshots and all(s["background"] is False for s in snapshots)


async def test_requested_values_are_echoed(app):
    sent = {"presence_penalty": 0.5, "frequency_penalty": -1.25, "max_tool_calls": 2, "safety_identifier": "user-42", "top_logprobs": 3, "service_tier": "flex"}
    async with client_for(app) as c:
        r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi", **sent}))
    assert r.status_code == 200, r.text
    _has_point0_fields(r.json(), **{**sent, "service_tier": "default"})


async def test_every_stream_snapshot_has_every_field(app):
    async with client_for(app) as c:
        r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}))
    events = _sse(r.text)
    assert_stream(events)
    snapshots = [e["response"] for e in events if "response" in e]
    assert [e["type"] for e in events if "response" in e][:2] == ["response.created", "response.in_progress"]
    for snap in snapshots:
        _has_point0_fields(snap)
        assert "background" not in snap
    for snap in snapshots[:2]:
        assert snap["usage"] is None and snap["completed_at"] is None  # present, null
    assert snapshots[-1]["usage"] is not None


async def test_background_response_has_every_field(app):
    async with client_for(app) as c:
        r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True}))
        assert r.status_code == 200, r.text
        first = r.json()
        _has_point0_fields(first)
        assert first["background"] is True
        rid = first["id"]
        for _ in range(200):
            got = (await bounded(c.get(f"/v1/responses/{rid}"))).json()
            if got["status"] not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.01)
    assert got["status"] == "completed", got
    _has_point0_fields(got)
    assert got["background"] is True
    assert_response(got)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": "lots"}, "frequency_penalty"),
        ({"service_tier": "gold"}, "service_tier"),
        ({"safety_identifier": "x" * 65}, "safety_identifier"),
        ({"include": ["message.input_image.image_url"]}, "include[0]"),
        ({"include": ["output_text.logprobz"]}, "include[0]"),
        ({"include": ["web_search_call.results"]}, "include[0]"),
        ({"max_tool_calls": 0}, "max_tool_calls"),
    ],
)
async def test_bad_new_fields_are_400(app, extra, param):
    async with client_for(app) as c:
        r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi", **extra}))
    assert r.status_code == 400, r.text
    assert_error(r.json())
    assert r.json()["error"]["param"] == param


async def test_supported_include_values_are_accepted(app):
    async with client_for(app) as c:
        r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi", "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}))
    assert r.status_code == 200, r.text
