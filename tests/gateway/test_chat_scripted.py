"""/v1/chat/completions through real gateway and worker processes with the scripted engine (named
as such: fixed reply text, one byte a token), driven by the OpenAI SDK and raw HTTP. Every object
and chunk is checked against the official Chat Completions schemas.

The real model covers the same paths in tests/e2e/test_chat_completions_real_model.py.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conformance import assert_component, assert_error
from tests.support import Kiln

MODEL = "kiln-scripted"
REPLY = "Hello from Kiln's scripted engine."
THINKING = "<think>The user greets me.</think>Hello there!"
CALLING = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
HI = [{"role": "user", "content": "hi"}]


def _server(tmp, reply):
    return Kiln(tmp, worker_args=["--engine", "scripted", "--scripted-reply", reply]).start(timeout=60)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    s = _server(tmp_path_factory.mktemp("chat-plain"), REPLY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    s = _server(tmp_path_factory.mktemp("chat-think"), THINKING)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def calling(tmp_path_factory):
    s = _server(tmp_path_factory.mktemp("chat-call"), CALLING)
    yield s
    s.stop()


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-local", max_retries=0, timeout=30)


def chat_stream(server, body: dict) -> list:
    """The data payloads of a streamed chat completion; the last one is the string "[DONE]"."""
    out: list = []
    with httpx.Client(base_url=server.base_url, timeout=30) as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_create_returns_a_conforming_completion(plain):
    resp = sdk(plain).chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be kind."}, *HI])
    assert_component(resp.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.content == REPLY and resp.choices[0].finish_reason == "stop"
    u = resp.usage
    assert u.completion_tokens == len(REPLY.encode()) and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.prompt_tokens_details.cached_tokens >= 0


def test_stream_has_role_first_usage_last_and_done(plain):
    payloads = chat_stream(plain, {"model": MODEL, "messages": HI, "stream_options": {"include_usage": True}})
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    for c in chunks:
        assert_component(c, "CreateChatCompletionStreamResponse")
        assert c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == REPLY
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(REPLY.encode())
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(plain):
    chunks = chat_stream(plain, {"model": MODEL, "messages": HI})[:-1]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_sdk_stream_collects_the_same_text(plain):
    seen = []
    for chunk in sdk(plain).chat.completions.create(model=MODEL, messages=HI, stream=True, stream_options={"include_usage": True}):
        assert_component(chunk.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionStreamResponse")
        seen.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in seen if c.choices) == REPLY
    assert seen[-1].usage.completion_tokens == len(REPLY.encode())


def test_max_tokens_gives_length(plain):
    resp = sdk(plain).chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.content == REPLY[:4]
    assert resp.usage.completion_tokens == 4


def test_stop_sequence_cuts_text_and_usage(plain):
    resp = sdk(plain).chat.completions.create(model=MODEL, messages=HI, stop=["Kiln"])
    assert_component(resp.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
    assert resp.choices[0].message.content == "Hello from " and resp.choices[0].finish_reason == "stop"
    assert 0 < resp.usage.completion_tokens < len(REPLY.encode())
    chunks = chat_stream(plain, {"model": MODEL, "messages": HI, "stop": "scripted", "stream_options": {"include_usage": True}})[:-1]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Hello from Kiln's "
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] < len(REPLY.encode())


def test_reasoning_is_reasoning_content(thinking):
    resp = sdk(thinking).chat.completions.create(model=MODEL, messages=HI, reasoning_effort="low")
    assert_component(resp.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
    msg = resp.choices[0].message
    assert msg.content == "Hello there!" and msg.model_extra["reasoning_content"] == "The user greets me."
    assert resp.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = chat_stream(thinking, {"model": MODEL, "messages": HI})[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user greets me."
    first_reasoning = next(i for i, d in enumerate(deltas) if d.get("reasoning_content"))
    first_text = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert first_reasoning < first_text


def test_tool_calls_stream_with_index_and_finish_tool_calls(calling):
    resp = sdk(calling).chat.completions.create(model=MODEL, messages=HI, tools=TOOLS)
    assert_component(resp.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = chat_stream(calling, {"model": MODEL, "messages": HI, "tools": TOOLS})[:-1]
    for c in chunks:
        assert_component(c, "CreateChatCompletionStreamResponse")
    parts = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert parts and all(p["index"] == 0 for p in parts) and parts[0]["id"] and parts[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(p["function"].get("arguments", "") for p in parts)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # The round trip: the assistant's call and the tool's result are accepted as history.
    follow = sdk(calling).chat.completions.create(model=MODEL, tools=TOOLS, messages=[*HI, choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].message is not None


def test_errors_use_the_openai_shape(plain):
    client = sdk(plain)
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=HI)
    assert_error(nf.value.response.json())
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HI, n=2)
    assert bad.value.param == "n"
    assert_error(bad.value.response.json())
    r = httpx.post(plain.base_url + "/chat/completions", json={"model": MODEL}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_failure_mid_stream_is_an_error_payload(plain):
    with pytest.raises(openai.APIError):
        for _ in sdk(plain).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[[error]]"}], stream=True):
            pass
    payloads = chat_stream(plain, {"model": MODEL, "messages": [{"role": "user", "content": "[[error]]"}]})
    assert payloads[-1] == "[DONE]" and "error" in payloads[-2]
    assert_error(payloads[-2])


# -- legacy /v1/completions ---------------------------------------------------------------------------

def test_legacy_completion_continues_the_raw_prompt(plain):
    prompt = "Once upon a time"
    resp = sdk(plain).completions.create(model=MODEL, prompt=prompt, max_tokens=64)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == REPLY and resp.choices[0].finish_reason == "stop"
    # The byte tokenizer counts exactly the prompt: no chat template was applied.
    assert resp.usage.prompt_tokens == len(prompt.encode())
    assert sdk(plain).completions.create(model=MODEL, prompt=[prompt]).choices[0].finish_reason == "length"  # 16 tokens by default


def test_legacy_completion_stream_stop_and_usage(plain):
    chunks = list(sdk(plain).completions.create(model=MODEL, prompt="x", max_tokens=64, stream=True, stop=["scripted"], stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello from Kiln's "
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens < len(REPLY.encode())
    with httpx.Client(base_url=plain.base_url, timeout=30) as c, c.stream("POST", "/completions", json={"model": MODEL, "prompt": "x", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"


def test_legacy_completion_refusals(plain):
    for extra, param in (({"n": 2}, "n"), ({"echo": True}, "echo"), ({"prompt": [[1, 2]]}, "prompt"), ({"prompt": ""}, "prompt"), ({"logprobs": 9}, "logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            sdk(plain).completions.create(**{"model": MODEL, "prompt": "x", **extra})
        assert err.value.param == param
        assert_error(err.value.response.json())


def test_sdk_stream_helper_assembles_the_final_completion(calling, thinking):
    with sdk(calling).chat.completions.stream(model=MODEL, messages=HI, tools=TOOLS) as s:
        kinds = {event.type for event in s}
        final = s.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert final.choices[0].finish_reason == "tool_calls"
    with sdk(thinking).chat.completions.stream(model=MODEL, messages=HI) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.content == "Hello there!"
