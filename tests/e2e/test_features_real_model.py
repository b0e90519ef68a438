"""Structured output, forced tool calls, the tool loop, stored chains and compaction with the
bundled model, through real processes and the OpenAI SDK."""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import jsonschema
import pytest
from pydantic import BaseModel

from tests.conformance import assert_response, assert_stream
from tests.support import stream

MODEL = "smollm2-135m-instruct"
SCHEMAS = sorted((Path(__file__).parents[1] / "data" / "schemas").glob("*.json"))
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]},
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "Current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}}, "required": ["timezone"]},
}


def _structured(client, path: Path) -> tuple[str, str | None]:
    case = json.loads(path.read_text())
    # A sample may ramble inside an unbounded string until the token cap: that ends "incomplete"
    # (correctly). One more sample is drawn then; every completed output must validate.
    for _ in range(2):
        resp = client.responses.create(
            model=MODEL,
            input=case["prompt"],
            temperature=1.0,
            max_output_tokens=600,
            text={"format": {"type": "json_schema", "name": case["name"], "schema": case["schema"], "strict": True}},
        )
        if resp.status == "completed":
            break
    if resp.status != "completed":
        return case["name"], f"status {resp.status}"
    try:
        jsonschema.Draft202012Validator(case["schema"], format_checker=jsonschema.FormatChecker()).validate(json.loads(resp.output_text))
    except Exception as exc:  # noqa: BLE001 - reported per schema
        return case["name"], f"{type(exc).__name__}: {str(exc)[:200]}"
    return case["name"], None


def _check_schemas(client, paths) -> None:
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _structured(client, p), paths))
    failures = {name: why for name, why in results if why}
    assert not failures, failures


def test_schemas_validate(openai_client):
    """Every fifth schema in CI; the whole set below (marked slow)."""
    assert len(SCHEMAS) == 50
    _check_schemas(openai_client, SCHEMAS[::5])


@pytest.mark.slow
def test_all_fifty_schemas_validate(openai_client):
    _check_schemas(openai_client, SCHEMAS)


class Person(BaseModel):
    name: str
    age: int


def test_responses_parse_with_pydantic(openai_client):
    parsed = openai_client.responses.parse(model=MODEL, input="Invent a person: a name and an age.", text_format=Person, max_output_tokens=200, temperature=0)
    assert isinstance(parsed.output_parsed, Person)


def test_structured_stream_concatenates_to_valid_json(http):
    case = json.loads(SCHEMAS[0].read_text())
    names, events = stream(http, {"model": MODEL, "input": case["prompt"], "max_output_tokens": 300, "text": {"format": {"type": "json_schema", "name": "x", "schema": case["schema"]}}})
    assert_stream(events, names)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    jsonschema.validate(json.loads(text), case["schema"])


def test_structured_truncation_is_incomplete(openai_client):
    case = json.loads(SCHEMAS[0].read_text())
    resp = openai_client.responses.create(model=MODEL, input=case["prompt"], max_output_tokens=5, text={"format": {"type": "json_schema", "name": "x", "schema": case["schema"]}})
    assert resp.status == "incomplete"


PROMPTS = [
    "What's the weather in Paris?", "Is it raining in Tokyo?", "Weather for Berlin in fahrenheit please.", "How hot is it in Cairo?",
    "Tell me the weather in Lima.", "Should I take an umbrella in London?", "Temperature in Oslo?", "Weather report for Sydney.",
    "Hi!", "What time is it in New York?", "Give me a poem.", "Is Madrid sunny?", "Weather in Rome today?", "How cold is Moscow?",
    "Check the weather in Nairobi.", "What's it like outside in Toronto?", "Forecast for Mumbai.", "Weather in Seoul, celsius.",
    "Will it snow in Denver?", "Describe the weather in Athens.",
]


ONLY_TIME = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}, ONLY_TIME], ids=["required", "named", "allowed"])
@pytest.mark.parametrize("tries", [pytest.param(8, id="ci"), pytest.param(20, id="full", marks=pytest.mark.slow)])
def test_forced_tool_calls_always_validate(openai_client, choice, tries):
    def one(prompt):
        resp = openai_client.responses.create(model=MODEL, input=prompt, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, max_output_tokens=120)
        calls = [o for o in resp.output if o.type == "function_call"]
        assert resp.status == "completed", resp.status
        assert calls, resp.output
        tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0].name]
        jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
        if choice == ONLY_TIME:  # weather questions, but only get_time is allowed
            assert [c.name for c in calls] == ["get_time"]
        elif isinstance(choice, dict):
            assert calls[0].name == "get_weather"
        return True

    with cf.ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(one, PROMPTS[:tries])) == tries


def test_tool_loop_through_sdk(openai_client):
    first = openai_client.responses.create(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=120)
    call = next(o for o in first.output if o.type == "function_call")
    follow = openai_client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "What's the weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21, "sky": "clear"}'}],
        tools=[WEATHER],
        max_output_tokens=60,
    )
    assert follow.status in ("completed", "incomplete")
    assert any(o.type in ("message", "function_call") for o in follow.output)
    assert_response(follow.model_dump(mode="json", exclude_unset=True))


def test_streamed_tool_call_events(http):
    names, events = stream(http, {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 120})
    assert_stream(events, names)
    assert any(e["type"] == "response.function_call_arguments.done" for e in events)


def test_second_turn_reports_cached_tokens(openai_client):
    first = openai_client.responses.create(model=MODEL, input="Remember the number 42. Say OK.", max_output_tokens=8, temperature=0)
    second = openai_client.responses.create(model=MODEL, input="What number did I ask you to remember?", previous_response_id=first.id, max_output_tokens=8, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_compact_with_real_summary(http):
    items = [{"role": "user", "content": f"Fact {i}: the colour of box {i} is {c}."} for i, c in enumerate(["red", "green", "blue", "amber", "violet"])]
    history = []
    for item in items:
        history += [item, {"role": "assistant", "content": "Noted."}]
    history.append({"role": "user", "content": "Which box is blue?"})
    r = http.post("/v1/responses/compact", json={"model": MODEL, "input": history, "keep_tokens": 40, "max_output_tokens": 120})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [i["type"] for i in body["output"]].count("compaction") == 1
    follow = http.post("/v1/responses", json={"model": MODEL, "input": body["output"], "max_output_tokens": 16})
    assert follow.status_code == 200


# A tool written for an API that implements more of JSON Schema than llguidance does.
CONDITIONAL = {
    "type": "function",
    "name": "book_room",
    "description": "Book a hotel room in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "nights": {"type": "integer", "minimum": 1, "maximum": 30}, "breakfast": {"type": "boolean"}},
        "required": ["city", "nights"],
        "if": {"properties": {"breakfast": {"const": True}}},
        "then": {"required": ["nights"]},
        "dependentRequired": {"breakfast": ["city"]},
    },
}


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "name": "book_room"}])
def test_tools_with_if_then_and_dependent_required_are_served(openai_client, choice):
    """Gateway and worker compile tool arguments with the same options (kiln.protocol.grammar):
    keywords llguidance does not implement are ignored for tools, not refused by one of them."""
    resp = openai_client.responses.create(model=MODEL, input="Book me two nights in Paris.", tools=[CONDITIONAL], tool_choice=choice, max_output_tokens=80, temperature=0)
    assert resp.status in ("completed", "incomplete"), resp.status
    if choice != "auto":
        calls = [o for o in resp.output if o.type == "function_call"]
        assert calls and calls[0].name == "book_room", resp.output
        args = json.loads(calls[0].arguments)
        assert isinstance(args["city"], str) and 1 <= args["nights"] <= 30
