"""Reasoning items, sealed encrypted_content, the reasoning echo store and tool-call items,
through real processes with the scripted engine (named as such) replaying fixed model text.

Real-model tests (tests/e2e) cover the same paths with SmolLM2's own output.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conformance import assert_response, assert_stream
from tests.support import Kiln, stream

MODEL = "kiln-scripted"
THINKING = "<think>The user greets me.</think>Hello there!"
CALLING = 'Let me check.<tool_call>\n{"name": "spawn_agent", "arguments": {"task": "look around", "depth": 2}}\n</tool_call>'


def _server(tmp_path, reply):
    return Kiln(tmp_path, worker_args=["--engine", "scripted", "--scripted-reply", reply]).start(timeout=60)


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    s = _server(tmp_path_factory.mktemp("think"), THINKING)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def calling(tmp_path_factory):
    s = _server(tmp_path_factory.mktemp("call"), CALLING)
    yield s
    s.stop()


def test_reasoning_item_streams_before_message(thinking):
    with httpx.Client(base_url=thinking.base_url, timeout=30) as c:
        names, events = stream(c, {"model": MODEL, "input": "hi", "reasoning": {"effort": "low", "summary": "auto"}})
    assert_stream(events, names)
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "The user greets me."
    assert final["output"][1]["content"][0]["text"] == "Hello there!"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert final["reasoning"] == {"effort": "low", "summary": "auto"}
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")


def test_encrypted_reasoning_round_trips_and_forgery_is_refused(thinking):
    with httpx.Client(base_url=thinking.base_url, timeout=30) as c:
        first = c.post("/v1/responses", json={"model": MODEL, "input": "hi", "include": ["reasoning.encrypted_content"], "store": False}).json()
        reasoning = first["output"][0]
        assert reasoning["encrypted_content"].startswith("kiln1.")
        assert_response(first)
        replay = [{"role": "user", "content": "hi"}, reasoning, first["output"][1], {"role": "user", "content": "again"}]
        ok = c.post("/v1/responses", json={"model": MODEL, "input": replay})
        assert ok.status_code == 200, ok.text
        body, mac = reasoning["encrypted_content"].rsplit(".", 1)
        forged = {**reasoning, "encrypted_content": body[:-2] + "AA." + mac}
        bad = c.post("/v1/responses", json={"model": MODEL, "input": [forged, {"role": "user", "content": "x"}]})
        assert bad.status_code == 400 and "encrypted_content" in bad.json()["error"]["param"]
        foreign = {**reasoning, "encrypted_content": "gAAAAABforeignblob"}
        assert c.post("/v1/responses", json={"model": MODEL, "input": [foreign, {"role": "user", "content": "x"}]}).status_code == 200


def test_reasoning_echo_restores_dropped_reasoning(thinking):
    with httpx.Client(base_url=thinking.base_url, timeout=30) as c:
        first = c.post("/v1/responses", json={"model": MODEL, "input": "hi"}).json()
        message = first["output"][1]
        second = c.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": "hi"}, message, {"role": "user", "content": "more"}]}).json()
        items = c.get(f"/v1/responses/{second['id']}/input_items", params={"order": "asc"}).json()["data"]
        assert [i["type"] for i in items] == ["message", "reasoning", "message", "message"]


def test_tool_call_items_with_namespace(calling):
    tools = [{"type": "namespace", "name": "multi_agent_v1", "description": "agents",
        "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {"task": {"type": "string"}, "depth": {"type": "integer"}}}}]}]
    with httpx.Client(base_url=calling.base_url, timeout=30) as c:
        names, events = stream(c, {"model": MODEL, "input": "go", "tools": tools})
        plain = c.post("/v1/responses", json={"model": MODEL, "input": "go", "tools": tools}).json()
    assert_stream(events, names)
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    call = final["output"][1]
    assert call["namespace"] == "multi_agent_v1" and call["name"] == "spawn_agent"
    assert json.loads(call["arguments"]) == {"task": "look around", "depth": 2}
    assert final["output"][0]["content"][0]["text"] == "Let me check."
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(deltas) == json.loads(call["arguments"])
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"][0]
    assert done["name"] == "spawn_agent" and done["item_id"] == call["id"]
    assert "<tool_call>" not in "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")
    assert [i["type"] for i in plain["output"]] == ["message", "function_call"]
    assert_response(plain)


def test_tool_loop_replays_call_and_output(calling):
    tools = [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]
    with httpx.Client(base_url=calling.base_url, timeout=30) as c:
        first = c.post("/v1/responses", json={"model": MODEL, "input": "go", "tools": tools}).json()
        call = first["output"][-1]
        follow = [{"role": "user", "content": "go"}, *first["output"], {"type": "function_call_output", "call_id": call["call_id"], "output": "agent spawned"}]
        r = c.post("/v1/responses", json={"model": MODEL, "input": follow, "tools": tools})
        assert r.status_code == 200, r.text
        count = c.post("/v1/responses/input_tokens", json={"model": MODEL, "input": follow, "tools": tools}).json()
        assert count["input_tokens"] > 0


def test_encrypted_reasoning_is_opaque_and_round_trips(tmp_path):
    """--encrypt-reasoning (the hosted operator's choice): the blob is AES-GCM (``kiln2.``), the
    reasoning cannot be read from it, it replays, and a changed byte is refused with 400."""
    server = Kiln(tmp_path, gateway_args=["--encrypt-reasoning"], worker_args=["--engine", "scripted", "--scripted-reply", THINKING]).start(timeout=60)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as c:
            first = c.post("/v1/responses", json={"model": MODEL, "input": "hi", "include": ["reasoning.encrypted_content"], "store": False}).json()
            reasoning = first["output"][0]
            blob = reasoning["encrypted_content"]
            assert blob.startswith("kiln2.") and "greets" not in blob
            assert_response(first)
            carried = {"type": "reasoning", "summary": [], "encrypted_content": blob}  # the blob alone, as Codex carries it
            ok = c.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": "hi"}, carried, first["output"][1], {"role": "user", "content": "again"}]})
            assert ok.status_code == 200, ok.text
            tampered = {**carried, "encrypted_content": blob[:-3] + ("A" if blob[-3] != "A" else "B") + blob[-2:]}
            bad = c.post("/v1/responses", json={"model": MODEL, "input": [tampered, {"role": "user", "content": "x"}]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].encrypted_content"
    finally:
        server.stop()
