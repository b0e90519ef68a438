"""Every door reaches the worker through one typed request (gateway/pool/worker_request.py).

In process, against a fake worker pool that records what it was sent after a msgpack round trip
(what a real worker would decode): the Responses API over HTTP and WebSocket, Chat Completions,
legacy Completions and Anthropic Messages each become a ``GenerateRequest`` with the same shape,
token counting and compaction send the same value, and a sampling value the worker could not
honour is a 400 ``invalid_request_error`` naming the parameter, from every door, before anything
is sent.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from kiln.gateway.http.app import create_app
from kiln.gateway.settings import Settings
from kiln.protocol import Compact, CountTokens, Generate, decode, encode
from kiln.protocol.request import ContentPart, FunctionCall, FunctionCallOutput, GenerateRequest, Message, Sampling, ToolChoice
from tests.gateway.inprocess import CONTEXT_WINDOW, MODEL, FakePool

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class RecordingPool(FakePool):
    """The fake pool, keeping every request message it was sent (as decoded off the wire)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[Any] = []

    async def _send(self, identity: bytes, message: Any) -> None:
        decoded = decode(encode(message))
        if isinstance(decoded, (Generate, CountTokens, Compact)):
            self.sent.append(decoded)
        await super()._send(identity, message)

    def request(self, kind: type = Generate) -> GenerateRequest:
        (message,) = [m for m in self.sent if isinstance(m, kind)]
        return message.request


@pytest.fixture
def gateway():
    pool = RecordingPool()
    with TestClient(create_app(Settings(), pool=pool), base_url="http://127.0.0.1") as client:
        client.pool = pool
        yield client


def test_responses_body_becomes_the_typed_request(gateway):
    body = {
        "model": MODEL,
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        ],
        "tools": [
            {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": WEATHER},
            {"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "read", "strict": False}]},
        ],
        "tool_choice": {"type": "function", "name": "read"},
        "parallel_tool_calls": False,
        "max_tool_calls": 3,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}},
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "max_output_tokens": 20,
        "top_logprobs": 2,
        "presence_penalty": 0.5,
        "prompt_cache_key": "agent-1",
        "store": False,
    }
    r = gateway.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    request = gateway.pool.request()
    assert request.model == MODEL and request.instructions == "Be brief." and request.raw_prompt is None
    assert request.input == (
        Message("user", (ContentPart("input_text", "Weather in Oslo?"),)),
        FunctionCall("c1", "get_weather", '{"city": "Oslo"}'),
        FunctionCallOutput("c1", "rain"),
        Message("assistant", (ContentPart("refusal", "no"),)),
    )
    weather, read = request.tools
    assert (weather.name, weather.namespace, weather.description, weather.parameters, weather.strict) == ("get_weather", None, "Weather.", WEATHER, True)
    assert (read.name, read.namespace, read.strict) == ("read", "fs", False)
    assert read.parameters == {"type": "object", "properties": {}}
    assert request.tool_choice == ToolChoice("named", name="read") and request.forces_call
    assert request.parallel_tool_calls is False and request.max_tool_calls == 3
    assert request.text_format.type == "json_schema" and request.text_format.schema == WEATHER
    assert request.sampling == Sampling(temperature=0.5, top_p=0.9, top_logprobs=2, logprobs=True, seed=7, max_output_tokens=20, presence_penalty=0.5)
    assert request.cache_key == "agent-1"


def test_chat_completions_reach_the_same_request(gateway):
    r = gateway.post("/v1/chat/completions", json={
        "model": MODEL,
        "messages": [{"role": "system", "content": "Terse."}, {"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        "tool_choice": "required",
        "seed": 3, "temperature": 0, "max_completion_tokens": 9, "logprobs": True,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    request = gateway.pool.request()
    assert [type(i) for i in request.input] == [Message, Message] and request.input[1].text == "Hi"
    assert [t.name for t in request.tools] == ["get_weather"] and request.tool_choice == ToolChoice("required")
    assert (request.sampling.seed, request.sampling.temperature, request.sampling.max_output_tokens, request.sampling.logprobs) == (3, 0.0, 9, True)


def test_legacy_completions_send_the_raw_prompt(gateway):
    r = gateway.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 5, "seed": 1})
    assert r.status_code == 200, r.text
    request = gateway.pool.request()
    assert request.raw_prompt == "Once upon" and request.sampling.max_output_tokens == 5 and request.sampling.seed == 1


def test_anthropic_messages_reach_the_same_request(gateway):
    r = gateway.post("/v1/messages", json={
        "model": MODEL, "max_tokens": 12, "system": "Terse.", "temperature": 0.2,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    })  # fmt: skip
    assert r.status_code == 200, r.text
    request = gateway.pool.request()
    assert request.instructions == "Terse." and request.input[-1] == Message("user", (ContentPart("input_text", "Weather?"),))
    assert [t.name for t in request.tools] == ["get_weather"] and request.tool_choice == ToolChoice("named", name="get_weather")
    assert (request.sampling.max_output_tokens, request.sampling.temperature) == (12, 0.2)


def test_websocket_turns_reach_the_same_request(gateway):
    with gateway.websocket_connect("ws://127.0.0.1/v1/responses") as ws:
        ws.send_text(json.dumps({"type": "response.create", "model": MODEL, "input": "hi", "seed": 5, "store": False}))
        while json.loads(ws.receive_text())["type"] not in ("response.completed", "response.failed", "error"):
            pass
    request = gateway.pool.request()
    assert request.input == (Message("user", (ContentPart("input_text", "hi"),)),) and request.sampling.seed == 5
    assert request.cache_key is None  # the connection's session routes it; the prefix cache key stays the client's


def test_token_counting_and_compaction_send_the_same_request(gateway):
    history = [{"type": "message", "role": "user", "content": "one"}, {"type": "message", "role": "assistant", "content": "two"}, {"type": "message", "role": "user", "content": "three"}]
    assert gateway.post("/v1/responses/input_tokens", json={"model": MODEL, "input": history, "instructions": "Be brief."}).status_code == 200
    counted = gateway.pool.request(CountTokens)
    assert counted.instructions == "Be brief." and [i.text for i in counted.input] == ["one", "two", "three"]
    assert gateway.post("/v1/responses/compact", json={"model": MODEL, "input": history}).status_code == 200
    compact = [m for m in gateway.pool.sent if isinstance(m, Compact)][0]
    assert [i.text for i in compact.request.input] == ["one", "two", "three"] and compact.keep_tokens > 0


BAD_SAMPLING = [
    ("seed", -1), ("seed", 1.5), ("seed", "x"), ("seed", 2**70), ("max_output_tokens", 2**63), ("top_logprobs", 100),
    ("top_p", 0),  # the create checks admit 0; the typed request, which the sampler needs, does not
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING)
def test_bad_sampling_is_400_naming_the_param_and_nothing_is_sent(gateway, field, value):
    raw = '{"model": "%s", "input": "hi", "%s": %s}' % (MODEL, field, json.dumps(value))  # 2**70 as a JSON integer
    r = gateway.post("/v1/responses", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", field)
    assert "Error" not in error["message"] and gateway.pool.sent == []


@pytest.mark.parametrize(("field", "value"), [("seed", -1), ("seed", 1.5), ("seed", "x"), ("top_p", 0)])
def test_bad_sampling_is_400_from_every_door(gateway, field, value):
    chat = gateway.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value})
    completion = gateway.post("/v1/completions", json={"model": MODEL, "prompt": "hi", field: value})
    with gateway.websocket_connect("ws://127.0.0.1/v1/responses") as ws:
        ws.send_text(json.dumps({"type": "response.create", "model": MODEL, "input": "hi", field: value}))
        frame = json.loads(ws.receive_text())
    for r in (chat, completion):
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["type"], r.json()["error"]["param"]) == ("invalid_request_error", field)
    assert frame["type"] == "error" and frame["status"] == 400 and frame["error"]["param"] == field
    assert gateway.pool.sent == []


def test_anthropic_bad_top_p_is_a_400(gateway):
    r = gateway.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "top_p": 0, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and gateway.pool.sent == []


def test_both_count_endpoints_count_through_the_same_counter(gateway):
    """``/v1/responses/input_tokens`` and ``/v1/messages/count_tokens`` share one counter: the same
    conversation is sent to the worker as the same request."""
    assert gateway.post("/v1/responses/input_tokens", json={"model": MODEL, "instructions": "Be brief.", "input": [{"role": "user", "content": "hi"}]}).status_code == 200
    openai_style = gateway.pool.request(CountTokens)
    gateway.pool.sent.clear()
    assert gateway.post("/v1/messages/count_tokens", json={"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert gateway.pool.request(CountTokens) == openai_style and openai_style.instructions == "Be brief."


def test_anthropic_max_tokens_above_the_window_is_capped_where_responses_refuses_it(gateway):
    """Claude Code asks for max_tokens 32000 whatever the model: the Messages door lowers it to
    the context window (its own option), while /v1/responses refuses the same value."""
    r = gateway.post("/v1/messages", json={"model": MODEL, "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert gateway.pool.request().sampling.max_output_tokens == CONTEXT_WINDOW
    r = gateway.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 32000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
