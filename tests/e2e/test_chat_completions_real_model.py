"""/v1/chat/completions with the bundled model (SmolLM2-135M-Instruct) through real gateway and
worker processes, driven by the OpenAI Python SDK. Every object and chunk is validated against
CreateChatCompletionResponse / CreateChatCompletionStreamResponse of the official schema."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.conformance import assert_component, assert_error

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]},
    },
}
TIME = {"type": "function",
    "function": {"name": "get_time", "description": "Current time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}}, "required": ["timezone"]}}}


def conforms(obj) -> None:
    assert_component(obj.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")


def test_create_text(openai_client):
    resp = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    conforms(resp)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 0 and 0 < resp.usage.completion_tokens <= 24
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_stream_text_with_usage_chunk(openai_client):
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    for c in chunks:
        assert_component(c.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionStreamResponse")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    final = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=32, temperature=0)
    assert text and text == final.choices[0].message.content  # temperature 0: same text either way
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == final.usage.completion_tokens


def test_forced_tool_call_validates(openai_client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        resp = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is it raining in Tokyo?"}], tools=[WEATHER, TIME], tool_choice=choice, max_tokens=120)
        conforms(resp)
        assert resp.choices[0].finish_reason == "tool_calls"
        call = resp.choices[0].message.tool_calls[0]
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"


def test_tool_round_trip(openai_client):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21, "sky": "clear"}'}]
    follow = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=60)
    conforms(follow)
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls
    # The call and its result reached the prompt: without the tool message it is shorter.
    shorter = openai_client.chat.completions.create(model=MODEL, messages=messages[:-1], tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert follow.usage.prompt_tokens > shorter.usage.prompt_tokens


def test_streamed_tool_call_arguments(openai_client):
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Berlin?"}], tools=[WEATHER], tool_choice="required", max_tokens=120,
        stream=True))
    for c in chunks:
        assert_component(c.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionStreamResponse")
    parts = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert len([p for p in parts if p.function and p.function.arguments]) > 1  # streamed as generated, not in one piece
    arguments = "".join(p.function.arguments or "" for p in parts if p.index == 0 and p.function)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


class Person(BaseModel):
    name: str
    age: int


def test_parse_with_pydantic(openai_client):
    messages = [{"role": "user", "content": "Invent a person: a name and an age."}]
    raw = openai_client.chat.completions.with_raw_response.parse(model=MODEL, messages=messages, response_format=Person, max_tokens=200, temperature=0)
    # What was on the wire conforms (the SDK's parsed object adds client-side fields such as 'parsed').
    assert_component(raw.http_response.json(), "CreateChatCompletionResponse")
    parsed = raw.parse()
    assert isinstance(parsed.choices[0].message.parsed, Person)


def test_json_object(openai_client):
    resp = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with a key 'colour'."}], response_format={"type": "json_object"}, max_tokens=80)
    conforms(resp)
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_logprobs(openai_client):
    resp = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    conforms(resp)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens or len(entries) == resp.usage.completion_tokens - 1  # the EOS token has no text
    assert all(e.logprob <= 0 and 1 <= len(e.top_logprobs) <= 3 for e in entries)
    assert "".join(e.token for e in entries) == resp.choices[0].message.content
    streamed = [c for c in openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
        stream=True) if c.choices and c.choices[0].logprobs]
    assert [e.token for c in streamed for e in c.choices[0].logprobs.content] == [e.token for e in entries]


def test_stop_sequence(openai_client):
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    assert "," in text, text
    stop = text[text.index(",") :][:2]
    cut = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=[stop])
    conforms(cut)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < full.usage.completion_tokens


def test_second_turn_reports_cached_tokens(openai_client):
    history = [{"role": "system", "content": "You are a helpful assistant who remembers numbers. " * 8}, {"role": "user", "content": "Remember the number 42. Say OK."}]
    first = openai_client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Which number?"}]
    second = openai_client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_refusals(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)
    assert err.value.param == "n" and "n" in err.value.message
    assert_error(err.value.response.json())
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10**9)
    assert err.value.param == "max_output_tokens"  # the shared validator's check, by its Responses name


def test_legacy_completion_is_a_raw_continuation(openai_client):
    prompt = "The capital of France is"
    resp = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    assert resp.object == "text_completion" and resp.choices[0].text
    chat = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1)
    assert resp.usage.prompt_tokens < chat.usage.prompt_tokens  # no chat template around the prompt
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    streamed = "".join(c.choices[0].text for c in openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == resp.choices[0].text
