"""The Anthropic Messages API on the bundled model, through real gateway and worker processes,
driven by the real ``anthropic`` SDK. Every object is the SDK's own parsed type; the raw stream is
checked event by event against the SDK's event types too.

The SDK no longer takes ``temperature`` as an argument (current Claude models fix it), so tests
that want greedy decoding send it in ``extra_body``, as any client may.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
EVENT = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture
def claude(kiln):
    return anthropic.Anthropic(base_url=kiln.base_url, api_key="sk-local", max_retries=0, timeout=900)


def _prompt_tokens(message: Message) -> int:
    """The prompt's length: Anthropic counts prefix-cache hits apart from input_tokens."""
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_create_returns_a_message(claude):
    m = claude.messages.create(model=MODEL, max_tokens=24, system="You are terse.", messages=[{"role": "user", "content": "What is the capital of France?"}], extra_body=GREEDY)
    assert isinstance(m, Message) and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert m.content and m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert _prompt_tokens(m) > 0 and 0 < m.usage.output_tokens <= 24


def test_max_tokens_stops_with_max_tokens(claude):
    m = claude.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Write a long story about a cat."}], extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stream_helpers_and_final_message(claude):
    kwargs = {"model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": "Say hello."}], "extra_body": GREEDY}
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    created = claude.messages.create(**kwargs)
    assert created.content[0].text == text  # greedy: the same answer either way
    assert _prompt_tokens(created) == _prompt_tokens(final)


def test_raw_stream_events_in_order(kiln):
    body = {"model": MODEL, "max_tokens": 16, "stream": True, "temperature": 0, "messages": [{"role": "user", "content": "Say hi."}]}
    with httpx.Client(base_url=kiln.base_url, timeout=900) as c, c.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        names, events = [], []
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert names == [e["type"] for e in events]
    for event in events:
        if event["type"] != "ping":
            EVENT.validate_python(event)
    kinds = [k for i, k in enumerate(names) if i == 0 or k != names[i - 1]]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"], kinds
    assert events[0]["message"]["usage"]["input_tokens"] + events[0]["message"]["usage"]["cache_read_input_tokens"] > 0


def test_forced_tool_use_and_a_tool_result_round_trip(claude):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = claude.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, messages=ask, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    call = next(b for b in m.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input, dict) and isinstance(call.input.get("city"), str)
    follow = ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 degrees Celsius."}]},
    ]
    answer = claude.messages.create(model=MODEL, max_tokens=48, tools=[WEATHER], tool_choice={"type": "none"}, messages=follow, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text.strip()
    # the call and its result were rendered into the prompt (same tool_choice, so same tool prompt)
    asked = claude.messages.count_tokens(model=MODEL, tools=[WEATHER], tool_choice={"type": "none"}, messages=ask).input_tokens
    assert _prompt_tokens(answer) > asked


def test_streamed_forced_tool_use_with_any(claude):
    with claude.messages.stream(model=MODEL, max_tokens=64, tools=[WEATHER], tool_choice={"type": "any"}, messages=[{"role": "user", "content": "Weather in Oslo?"}], extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    call = next(b for b in final.content if b.type == "tool_use")
    assert call.name == "get_weather" and "city" in call.input


def test_count_tokens_equals_the_prompt_tokens_generation_reports(claude):
    tools = [WEATHER]
    for messages, system in (
        ([{"role": "user", "content": "Count these words please."}], None),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather in Rome?"}], "Be brief."),
    ):
        extra = {"system": system} if system else {}
        counted = claude.messages.count_tokens(model=MODEL, messages=messages, tools=tools, **extra)
        m = claude.messages.create(model=MODEL, max_tokens=2, messages=messages, tools=tools, extra_body=GREEDY, **extra)
        assert counted.input_tokens == _prompt_tokens(m) > 0


def test_stop_sequences(claude):
    plain = claude.messages.create(model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY)
    text = plain.content[0].text
    stop = text.split()[1] if len(text.split()) > 1 else text[1:3]
    m = claude.messages.create(model=MODEL, max_tokens=32, stop_sequences=[stop], messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def test_errors_in_anthropics_shape(claude, kiln):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body == {"type": "error", "error": {"type": "not_found_error", "message": err.value.body["error"]["message"]}}
    r = httpx.post(kiln.base_url + "/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]


def test_claude_code_mid_conversation_system_message_is_answered(kiln):
    """Claude Code 2.1.332's first request of a prompt, in its shape (beta
    mid-conversation-tool-changes-2026-07-01): a ``role: "system"`` message after the user turn.
    Answered 200, not refused (Claude Code would retry without it, one request wasted)."""
    body = {
        "model": MODEL,
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332;"},
            {"type": "text", "text": "You are Claude Code. Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say hello.", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": [{"type": "text", "text": "Tools available now: none.", "cache_control": {"type": "ephemeral"}}]},
        ],
        "temperature": 0,
        "metadata": {"user_id": "user_0123_account__session_4567"},
    }
    headers = {"anthropic-beta": "claude-code-20250219,mid-conversation-tool-changes-2026-07-01", "anthropic-version": "2023-06-01", "x-api-key": "sk-local"}
    with httpx.Client(base_url=kiln.base_url, timeout=900) as c:
        with c.stream("POST", "/v1/messages?beta=true", json=body, headers=headers) as r:
            assert r.status_code == 200, r.read()
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
        counted = c.post("/v1/messages/count_tokens?beta=true", json={k: v for k, v in body.items() if k not in ("max_tokens", "stream")}, headers=headers)
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
