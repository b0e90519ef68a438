"""The Anthropic Messages door without a model: request translation, the event translator on
scripted Responses event sequences (thinking, tools, stop sequences split across deltas), and the
in-process routes' error shapes. Every object and event is parsed with the anthropic SDK's own
types, which is what a client does."""

from __future__ import annotations

import json

import anthropic
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from pydantic import TypeAdapter

from kiln.gateway.doors.anthropic.translate import (
    MessageTranslator,
    to_responses_body,
)
from kiln.gateway.doors.create_request import CreateRequest
from kiln.gateway.doors.stop import StopCutter
from kiln.gateway.doors.validation import validate_create
from kiln.gateway.http.app import create_app
from kiln.gateway.http.errors import ApiError
from kiln.gateway.settings import Settings
from kiln.protocol import Done, Event, Generate, decode, encode
from kiln.protocol.usage import Usage
from tests.gateway.inprocess import MODEL, FakePool, bounded, client_for, local_app

EVENT = TypeAdapter(RawMessageStreamEvent)


def parse_event(event: dict):
    """An event as the SDK reads it (its stream skips ``ping``, which has no type of its own)."""
    if event["type"] == "ping":
        assert event == {"type": "ping"}
        return None
    return EVENT.validate_python(event)


def _translate(raw: dict) -> CreateRequest:
    spec = to_responses_body(raw)
    return validate_create(spec.body)


def test_a_full_conversation_translates_into_a_valid_responses_body():
    body = _translate(
        {
            "model": "m",
            "max_tokens": 50,
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "text", "text": "Thanks"},
                ]},
            ],
            "tools": [{"name": "weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "temperature": 0.5,
            "top_k": 40,
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u1"},
        }
    )
    assert body.instructions == "Be brief.\nBe kind."
    assert body.max_output_tokens == 50 and body.temperature == 0.5 and body.store is False
    assert body.tool_choice == "required" and body.parallel_tool_calls is False
    assert body.tools == [{"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "description": "Weather"}]
    assert [i["type"] for i in body.input] == ["message", "reasoning", "message", "function_call", "function_call_output", "message"]
    call, result = body.input[3], body.input[4]
    assert (call["call_id"], call["name"], json.loads(call["arguments"])) == ("toolu_1", "weather", {"city": "Paris"})
    assert (result["call_id"], result["output"]) == ("toolu_1", "18C")
    assert body.input[1]["encrypted_content"] == "sig"
    assert "top_k" not in body.to_json()  # accepted, not applied: the sampler has no top-k


# The shape of Claude Code 2.1.332's first request of a prompt (beta header
# mid-conversation-tool-changes-2026-07-01): a system message after the user turn.
MID_CONVERSATION_SYSTEM = {
    "model": "m",
    "max_tokens": 32000,
    "stream": True,
    "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
        {"role": "system", "content": [{"type": "text", "text": "The tools changed: Bash is now available.", "cache_control": {"type": "ephemeral"}}]},
    ],
    "metadata": {"user_id": "user_abc"},
}


def test_a_mid_conversation_system_message_is_a_system_turn_at_its_place():
    from kiln.protocol.request import ContentPart
    from kiln.protocol.request import Message as InputMessage
    from kiln.worker.prompt import to_messages

    body = _translate(MID_CONVERSATION_SYSTEM)
    assert [(i["type"], i["role"]) for i in body.input] == [("message", "user"), ("message", "system")]
    assert body.input[1]["content"] == "The tools changed: Bash is now available."
    items = [InputMessage(i["role"], (ContentPart("input_text", i["content"] if isinstance(i["content"], str) else i["content"][0]["text"]),)) for i in body.input]
    rendered = to_messages(body.instructions, items, tool_markup=True)
    assert [m["role"] for m in rendered] == ["system", "user", "system"]
    assert rendered[2]["content"] == "The tools changed: Bash is now available."


@pytest.mark.parametrize(
    "raw, param",
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 5}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
        ({"model": "m", "max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}, "temperature"),
        ({"model": "m", "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}], "messages": [{"role": "user", "content": "x"}]}, "tools.0.type"),
        ({"model": "m", "max_tokens": 5, "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "x"}]}, "tool_choice"),
        ({"model": "m", "max_tokens": 5, "stop_sequences": "END", "messages": [{"role": "user", "content": "x"}]}, "stop_sequences"),
        ({"model": "m", "max_tokens": 5, "thinking": {"type": "sometimes"}, "messages": [{"role": "user", "content": "x"}]}, "thinking.type"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(raw, param):
    with pytest.raises(ApiError) as err:
        _translate(raw)
    assert err.value.status == 400 and err.value.param == param


def test_count_only_needs_no_max_tokens():
    spec = to_responses_body({"model": "m", "messages": [{"role": "user", "content": "x"}]}, count_only=True)
    assert "max_output_tokens" not in spec.body and spec.stream is False


def test_stop_cutter_holds_back_a_possible_start_and_finds_a_split_match():
    m = StopCutter(["STOP", "\n\n"])
    assert m.feed("Hello ST") == "Hello "
    assert m.feed("O") == ""
    assert m.feed("Px") == ""
    assert m.matched == "STOP"
    m = StopCutter(["STOP"])
    assert m.feed("a ST") == "a "
    assert m.feed("AY") == "STAY"
    assert m.flush() == ""


def _responses_events(*, reasoning: str = "", text: list[str] = (), call: tuple[str, list[str]] | None = None) -> list[dict]:
    """A Responses event sequence as the worker emits it: reasoning, message, then a call."""
    events: list[dict] = []
    index = 0
    if reasoning:
        events += [
            {"type": "response.output_item.added", "output_index": index, "item": {"type": "reasoning", "id": "rs_1"}},
            {"type": "response.reasoning_text.delta", "output_index": index, "delta": reasoning},
            {"type": "response.output_item.done", "output_index": index, "item": {"type": "reasoning", "id": "rs_1", "content": [{"type": "reasoning_text", "text": reasoning}]}},
        ]
        index += 1
    if text:
        events.append({"type": "response.output_item.added", "output_index": index, "item": {"type": "message", "id": "msg_1"}})
        events += [{"type": "response.output_text.delta", "output_index": index, "delta": t} for t in text]
        message_index = index
        index += 1
    if call is not None:
        name, parts = call
        events.append({"type": "response.output_item.added", "output_index": index, "item": {"type": "function_call", "call_id": "call_1", "name": name, "arguments": ""}})
        events += [{"type": "response.function_call_arguments.delta", "output_index": index, "delta": p} for p in parts]
    if text:
        events.append({"type": "response.output_item.done", "output_index": message_index, "item": {"type": "message", "content": [{"type": "output_text", "text": "".join(text)}]}})
    if call is not None:
        events.append({"type": "response.output_item.done", "output_index": index, "item": {"type": "function_call", "call_id": "call_1", "name": call[0], "arguments": "".join(call[1])}})
    return events


def _run(translator: MessageTranslator, events: list[dict], status: str = "completed") -> tuple[list[dict], dict]:
    usage = {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 7}
    out = translator.start_events(usage)
    for event in events:
        out += translator.feed(event)
    out += translator.end_events(status, usage)
    return out, translator.message(status, usage)


def _check_stream(out: list[dict]) -> None:
    """Each event parses with the SDK; blocks open and close one at a time, in index order."""
    for event in out:
        parse_event(event)
    kinds = [e["type"] for e in out]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    open_index = None
    next_index = 0
    for event in out:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == next_index
            open_index, next_index = event["index"], next_index + 1
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
        elif event["type"] == "content_block_stop":
            assert event["index"] == open_index
            open_index = None
    assert open_index is None


def test_thinking_text_and_a_tool_call_become_three_blocks():
    sealed = []
    translator = MessageTranslator("m", seal=lambda text: sealed.append(text) or "SIG")
    out, message = _run(translator, _responses_events(reasoning="Think.", text=["Let me ", "check."], call=("weather", ['{"city":', ' "Paris"}'])))
    _check_stream(out)
    parsed = Message.model_validate(message)
    assert [b.type for b in parsed.content] == ["thinking", "text", "tool_use"]
    assert parsed.content[0].thinking == "Think." and parsed.content[0].signature == "SIG" and sealed == ["Think."]
    assert parsed.content[1].text == "Let me check."
    assert parsed.content[2].input == {"city": "Paris"} and parsed.content[2].id == "call_1"
    assert parsed.stop_reason == "tool_use"
    assert (parsed.usage.input_tokens, parsed.usage.cache_read_input_tokens, parsed.usage.output_tokens) == (8, 4, 7)
    deltas = [e["delta"]["type"] for e in out if e["type"] == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta", "text_delta", "input_json_delta", "input_json_delta"]


class PlayingPool(FakePool):
    """The fake worker, answering a generation with a fixed Responses event sequence."""

    def __init__(self, events: list[dict]) -> None:
        super().__init__()
        self.events = events

    async def _send(self, identity: bytes, message) -> None:
        message = decode(encode(message))
        if not isinstance(message, Generate):
            return await super()._send(identity, message)
        usage = Usage(input_tokens=9, output_tokens=5)
        for event in self.events:
            await self._dispatch(identity, Event(message.req_id, [event], usage))
        await self._dispatch(identity, Done(message.req_id, "completed", usage))


def _sdk(app) -> anthropic.AsyncAnthropic:
    import httpx2  # what this SDK is built on

    transport = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1")
    return anthropic.AsyncAnthropic(base_url="http://127.0.0.1", api_key="x", max_retries=0, http_client=transport)


async def test_sdk_stream_helpers_and_create_agree_in_process():
    """messages.stream's helpers and get_final_message() build what messages.create returns."""
    events = _responses_events(text=["Hi", " there"], call=("f", ['{"a": ', "1}"]))
    pool = PlayingPool(events)
    app = create_app(Settings(), pool=pool)
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    kwargs = {"model": MODEL, "max_tokens": 16, "tools": tools, "messages": [{"role": "user", "content": "hi"}]}
    async with app.router.lifespan_context(app):
        sdk = _sdk(app)
        created = await bounded(sdk.messages.create(**kwargs))
        async with sdk.messages.stream(**kwargs) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
    assert text == "Hi there"
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"a": 1}
    assert final.model_dump(exclude={"id"}) == created.model_dump(exclude={"id"})
    assert final.usage.input_tokens == 9 and final.usage.output_tokens == 5 and final.stop_reason == "tool_use"
    assert pool.leaked() == []


def test_hidden_thinking_and_max_tokens():
    translator = MessageTranslator("m", show_thinking=False)
    out, message = _run(translator, _responses_events(reasoning="secret", text=["partial"]), status="incomplete")
    _check_stream(out)
    assert [b["type"] for b in message["content"]] == ["text"] and message["stop_reason"] == "max_tokens"


def test_a_stop_sequence_split_across_deltas_ends_the_message():
    translator = MessageTranslator("m", stop_sequences=["###"])
    events = _responses_events(text=["One two #", "## three"])
    out = translator.start_events(None)
    for event in events:
        out += translator.feed(event)
        if translator.stopped:
            break
    out += translator.end_events("cancelled", None)
    _check_stream(out)
    message = Message.model_validate(translator.message("cancelled", None))
    assert message.content[0].text == "One two " and message.stop_reason == "stop_sequence" and message.stop_sequence == "###"
    assert "".join(e["delta"]["text"] for e in out if e["type"] == "content_block_delta") == "One two "


def test_held_back_text_is_delivered_when_no_match_follows():
    translator = MessageTranslator("m", stop_sequences=["###"])
    out, message = _run(translator, _responses_events(text=["ends with #"]))
    _check_stream(out)
    assert message["content"][0]["text"] == "ends with #" and message["stop_reason"] == "end_turn"


# -- the routes in-process -------------------------------------------------------------------------
async def test_create_and_count_in_process_parse_with_sdk_types():
    app, pool = local_app()
    async with app.router.lifespan_context(app), client_for(app) as c:
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        r = await bounded(c.post("/v1/messages", json=body))
        assert r.status_code == 200, r.text
        message = Message.model_validate(r.json())
        assert message.usage.input_tokens == 3 and message.stop_reason == "end_turn"
        r = await bounded(c.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": body["messages"]}))
        assert MessageTokensCount.model_validate(r.json()).input_tokens == 3
        r = await bounded(c.post("/v1/messages", json={**body, "stream": True}))
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        assert names == [e["type"] for e in events] and names[0] == "message_start" and names[-1] == "message_stop"
        for event in events:
            parse_event(event)
        metrics = (await bounded(c.get("/metrics"))).text
    assert 'kiln_requests_total{route="/v1/messages",status="200"} 2.0' in metrics
    assert 'kiln_requests_total{route="/v1/messages/count_tokens",status="200"} 1.0' in metrics
    assert pool.leaked() == []


@pytest.mark.parametrize(
    "body, status, kind",
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
        ({"model": "no-such-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, 404, "not_found_error"),
        ("[1, 2", 400, "invalid_request_error"),
    ],
)
async def test_errors_are_in_anthropics_shape(body, status, kind):
    app, _ = local_app()
    async with app.router.lifespan_context(app), client_for(app) as c:
        content = body if isinstance(body, str) else json.dumps(body)
        r = await bounded(c.post("/v1/messages", content=content, headers={"content-type": "application/json"}))
    assert r.status_code == status
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and r.json()["error"]["message"]
    assert set(r.json()) == {"type", "error"}


async def test_the_sdk_raises_its_own_exception_classes():
    app, _ = local_app()
    async with app.router.lifespan_context(app):
        sdk = _sdk(app)
        with pytest.raises(anthropic.NotFoundError) as err:
            await bounded(sdk.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}]))
        assert err.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError):
            await bounded(sdk.messages.create(model=MODEL, max_tokens=4,
                messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]))
