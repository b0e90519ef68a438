"""The Chat door's translations, without processes: chat body -> Responses body (which the
Responses validator must accept), Responses events -> chat chunks, stop-sequence cutting."""

from __future__ import annotations

import pytest

from kiln.gateway.doors.anthropic.translate import MessageTranslator
from kiln.gateway.doors.chat.framer import ChatTranslator, chat_usage
from kiln.gateway.doors.chat.request import translate_chat
from kiln.gateway.doors.stop import StopCutter
from kiln.gateway.doors.validation import validate_create
from kiln.gateway.http.errors import ApiError
from tests.conformance import assert_component

TOOL = {"type": "function",
    "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_roles_tools_and_results_become_items():
    chat = translate_chat({
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "max_tokens": 10,
        "user": "u-1",
        "metadata": {"a": "b"},
    })
    body = validate_create(chat.body)
    assert [i["type"] for i in body.input] == ["message", "message", "message", "function_call", "function_call_output"]
    assert body.input[1] == {"type": "message", "role": "developer", "content": "Use tools."}
    assert body.input[3]["call_id"] == "call_1" and body.input[4]["output"] == "sunny"
    assert body.tools[0]["name"] == "get_weather" and "strict" not in body.tools[0]
    assert body.tool_choice == {"type": "function", "name": "get_weather"}
    assert body.parallel_tool_calls is False and body.store is False
    assert body.max_output_tokens == 10 and body.metadata == {"a": "b"}


def test_format_logprobs_and_limits():
    chat = translate_chat({
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema",
            "json_schema": {"name": "p", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}, "strict": True}},
        "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2, "stop": ["\n", "END"],
        "stream": True, "stream_options": {"include_usage": True},
    })
    body = validate_create(chat.body)
    assert body.text["format"]["type"] == "json_schema" and body.text["format"]["name"] == "p"
    assert body.max_output_tokens == 7
    assert body.include == ["message.output_text.logprobs"] and body.top_logprobs == 2
    assert chat.stop == ["\n", "END"] and chat.stream and chat.include_usage and chat.logprobs
    assert validate_create(translate_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_object"}}).body).text == {"format": {"type": "json_object"}}


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_refusals_name_the_parameter(extra, param):
    raw = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(ApiError) as err:
        validate_create(translate_chat(raw).body)
    assert err.value.status == 400 and err.value.param == param


def test_tool_choice_required_without_tools_is_refused_by_the_shared_validator():
    with pytest.raises(ApiError) as err:
        validate_create(translate_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}).body)
    assert err.value.param == "tool_choice"


def _text_events(pieces, logprobs=False):
    events = [{"type": "response.output_item.added", "output_index": 0, "item": {"id": "msg_1", "type": "message"}}]
    for p in pieces:
        lp = [{"token": p, "logprob": -0.1, "bytes": list(p.encode()), "top_logprobs": []}] if logprobs else []
        events.append({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": p, "logprobs": lp})
    return events


def _run(t: ChatTranslator, events):
    chunks = [t.opening()]
    for e in events:
        chunks.extend(t.feed(e))
    chunks.extend(t.flush())
    return chunks


def test_text_chunks_and_completion_conform():
    t = ChatTranslator("resp_abc", "m", logprobs=True, include_usage=True)
    chunks = _run(t, _text_events(["Hel", "lo"], logprobs=True))
    chunks.append(t.closing("completed"))
    usage = {"input_tokens": 5, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 3}, "output_tokens_details": {"reasoning_tokens": 0}}
    chunks.append(t.usage_chunk(usage))
    for c in chunks:
        assert_component(c, "CreateChatCompletionStreamResponse")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello"
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 and chunks[-1]["choices"] == []
    final = t.completion("completed", usage)
    assert_component(final, "CreateChatCompletionResponse")
    assert final["id"] == "chatcmpl-abc" and final["choices"][0]["finish_reason"] == "stop"
    assert [e["token"] for e in final["choices"][0]["logprobs"]["content"]] == ["Hel", "lo"]


def test_a_tool_call_stream_has_no_empty_content():
    """The first chunk says the role only: a ``content: ""`` before a tool call is an empty text
    part to the Vercel AI SDK."""
    t = ChatTranslator("resp_t", "m")
    item = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": ""}
    events = [
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0, "delta": '{"a": 1}'},
        {"type": "response.output_item.done", "output_index": 0, "item": {**item, "arguments": '{"a": 1}', "status": "completed"}},
    ]
    chunks = _run(t, events) + [t.closing("completed")]
    for c in chunks:
        assert_component(c, "CreateChatCompletionStreamResponse")
        assert "content" not in c["choices"][0]["delta"], c
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "f"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_stop_sequence_split_across_deltas_is_cut():
    t = ChatTranslator("resp_x", "m", stop=["STOP"])
    chunks = _run(t, _text_events(["one two ST", "OP three"]))
    assert t.stopped
    assert "".join(t.content) == "one two "
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "one two "
    assert t.finish_reason("cancelled") == "stop"


def test_stop_cutter_releases_everything_when_no_stop_appears():
    cut = StopCutter(["xyz"])
    out = cut.feed("abcx") + cut.feed("y") + cut.feed("w") + cut.flush()
    assert out == "abcxyw" and not cut.hit


def test_the_cutter_holds_back_only_a_possible_start():
    cut = StopCutter(["STOP", "\n\n", ""])
    assert cut.feed("a bit ") == "a bit " and cut.feed("of S") == "of " and cut.feed("Tx") == "STx"
    assert cut.feed("STO") == "" and cut.feed("P and more") == "" and cut.matched == "STOP" and cut.flush() == ""


@pytest.mark.parametrize("pieces", [["one two ST", "OP three"], ["S", "T", "OP"], ["no stop ", "here S", "TA"], ["end\n", "\nmore"]])
def test_chat_and_anthropic_cut_the_same_text(pieces):
    stops = ["STOP", "\n\n"]
    chat = ChatTranslator("resp_x", "m", stop=stops)
    _run(chat, _text_events(pieces))
    claude = MessageTranslator("m", stop_sequences=stops)
    for event in _text_events(pieces):
        claude.feed(event)
    claude.end_events("completed", None)
    text = "".join(block["text"] for block in claude.message("completed", None)["content"] if block["type"] == "text")
    assert "".join(chat.content) == text and chat.stopped == claude.stopped


def test_tool_call_deltas_carry_their_index():
    t = ChatTranslator("resp_x", "m")
    events = []
    for n, (name, args) in enumerate([("a", '{"x":1}'), ("b", '{"y":2}')]):
        item = {"id": f"fc_{n}", "type": "function_call", "call_id": f"call_{n}", "name": name, "arguments": ""}
        events.append({"type": "response.output_item.added", "output_index": n, "item": item})
        events.append({"type": "response.function_call_arguments.delta", "item_id": f"fc_{n}", "output_index": n, "delta": args[:3]})
        events.append({"type": "response.output_item.done", "output_index": n, "item": {**item, "arguments": args}})
    chunks = _run(t, events) + [t.closing("completed")]
    for c in chunks:
        assert_component(c, "CreateChatCompletionStreamResponse")
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert [c["index"] for c in calls] == [0, 0, 0, 1, 1, 1]
    assert "".join(c["function"].get("arguments", "") for c in calls if c["index"] == 1) == '{"y":2}'
    final = t.completion("completed", None)
    assert_component(final, "CreateChatCompletionResponse")
    msg = final["choices"][0]["message"]
    assert msg["content"] is None and [c["function"]["name"] for c in msg["tool_calls"]] == ["a", "b"]
    assert final["choices"][0]["finish_reason"] == "tool_calls"


def test_reasoning_deltas_become_reasoning_content():
    t = ChatTranslator("resp_x", "m")
    chunks = _run(t, [{"type": "response.reasoning_text.delta", "item_id": "rs_1", "output_index": 0, "content_index": 0, "delta": "hmm"}] + _text_events(["ok"]))
    assert chunks[1]["choices"][0]["delta"] == {"reasoning_content": "hmm"}
    assert t.message()["reasoning_content"] == "hmm" and t.message()["content"] == "ok"
    assert t.completion("incomplete", None)["choices"][0]["finish_reason"] == "length"


def test_usage_carries_cost_when_debited():
    from decimal import Decimal

    assert chat_usage({"input_tokens": 1, "output_tokens": 2}, Decimal("0.5"))["cost"] == 0.5
