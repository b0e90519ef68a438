"""A forced tool call cut short by the token cap, on every door, with the bundled model and the
real SDKs: no call markup ever reaches a client as text, and a call reported complete always has
arguments that are a JSON object. A call the cap cut is reported as an incomplete call in each
API's own terms (docs/tools.md, "A call cut off by the token cap").

The property holds for any cap; the default suite samples a few (the first tokens, where the open
tag is cut, and the middle of the arguments), ``-m slow`` sweeps every cap from 1 to 64. Sampling
is at the default temperature, so each run tries other outputs.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

MODEL = "smollm2-135m-instruct"
PROMPT = "What's the weather in Rome? Use the tool."
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["city"]}
MARKUP = ("<tool_call", "</tool_call", "tool_call>", '{"name', '"arguments"')

FAST_CAPS = [1, 2, 3, 5, 8, 13, 21]
ALL_CAPS = [pytest.param(cap, marks=pytest.mark.slow) for cap in range(1, 65) if cap not in FAST_CAPS]


def _no_markup(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), f"call markup reached the client as text: {text!r}"


def _object(arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)
    assert isinstance(value, dict), arguments
    return value


@pytest.fixture
def oai(kiln):
    return openai.OpenAI(base_url=f"{kiln.base_url}/v1", api_key="sk-local", max_retries=0, timeout=900)


@pytest.fixture
def claude(kiln):
    return anthropic.Anthropic(base_url=kiln.base_url, api_key="sk-local", max_retries=0, timeout=900)


def _check_responses(response: Any, cap: int) -> None:
    calls = [item for item in response.output if item.type == "function_call"]
    for item in response.output:
        if item.type == "message":
            for part in item.content:
                _no_markup(getattr(part, "text", ""))
    assert [c.name for c in calls] == ["get_weather"], response.output
    call = calls[0]
    if call.status == "completed":
        _object(call.arguments)
    else:
        assert call.status == "incomplete" and response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens <= cap


def _responses_kwargs(cap: int) -> dict[str, Any]:
    tool = {"type": "function", "name": "get_weather", "description": "Weather for a city.", "parameters": PARAMS, "strict": False}
    return {"model": MODEL, "input": PROMPT, "tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": cap}


def _chat_kwargs(cap: int) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": PARAMS}}
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": cap}


def _messages_kwargs(cap: int) -> dict[str, Any]:
    tool = {"name": "get_weather", "description": "Weather for a city.", "input_schema": PARAMS}
    return {"model": MODEL, "max_tokens": cap, "messages": [{"role": "user", "content": PROMPT}], "tools": [tool], "tool_choice": {"type": "tool", "name": "get_weather"}}


@pytest.mark.parametrize("cap", FAST_CAPS + ALL_CAPS)
def test_responses(oai, cap):
    _check_responses(oai.responses.create(**_responses_kwargs(cap)), cap)
    deltas: dict[str, list[str]] = {}
    final = None
    for event in oai.responses.create(**_responses_kwargs(cap), stream=True):
        if event.type == "response.output_text.delta":
            _no_markup(event.delta)
        elif event.type == "response.function_call_arguments.delta":
            deltas.setdefault(event.item_id, []).append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None
    _check_responses(final, cap)
    call = next(item for item in final.output if item.type == "function_call")
    assert "".join(deltas.get(call.id, [])) == call.arguments


@pytest.mark.parametrize("cap", FAST_CAPS + ALL_CAPS)
def test_chat_completions(oai, cap):
    completion = oai.chat.completions.create(**_chat_kwargs(cap))
    choice = completion.choices[0]
    _no_markup(choice.message.content)
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather"]
    if choice.finish_reason == "tool_calls":
        _object(choice.message.tool_calls[0].function.arguments)
    else:
        assert choice.finish_reason == "length"

    text, arguments, names, finish = [], [], [], None
    for chunk in oai.chat.completions.create(**_chat_kwargs(cap), stream=True):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            for tc in c.delta.tool_calls or []:
                names.append(tc.function.name) if tc.function and tc.function.name else None
                arguments.append(tc.function.arguments or "" if tc.function else "")
            finish = c.finish_reason or finish
    _no_markup("".join(text))
    assert names == ["get_weather"]
    if finish == "tool_calls":
        _object("".join(arguments))
    else:
        assert finish == "length"


@pytest.mark.parametrize("cap", FAST_CAPS + ALL_CAPS)
def test_anthropic_messages(claude, cap):
    def check(message: Any) -> None:
        blocks = [b for b in message.content if b.type == "tool_use"]
        for b in message.content:
            if b.type == "text":
                _no_markup(b.text)
        assert [b.name for b in blocks] == ["get_weather"]
        assert isinstance(blocks[0].input, dict)
        assert message.stop_reason in ("tool_use", "max_tokens")

    check(claude.messages.create(**_messages_kwargs(cap)))
    partial: list[str] = []
    with claude.messages.stream(**_messages_kwargs(cap)) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
            elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                _no_markup(event.delta.text)
        final = stream.get_final_message()
    check(final)
    if final.stop_reason == "tool_use":  # a call to run: what streamed is its whole input
        assert _object("".join(partial)) == final.content[-1].input
