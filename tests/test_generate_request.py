"""The typed request (kiln.protocol.request): ranges checked at construction, a wire form that
round-trips through the codec, ignores what a newer peer adds, and re-checks every range on
decode so that a bad frame is a 400 naming the parameter."""

from __future__ import annotations

import math

import msgpack
import pytest

from kiln.protocol import Compact, CountTokens, Generate, InvalidRequest, ProtocolError, decode, encode
from kiln.protocol.request import (
    MAX_SEED,
    ContentPart,
    FunctionCall,
    FunctionCallOutput,
    GenerateRequest,
    InvalidParam,
    Marker,
    Message,
    Reasoning,
    Sampling,
    TextFormat,
    ToolChoice,
    ToolSpec,
)

FULL = GenerateRequest(
    model="m",
    input=(
        Message("system", (ContentPart("input_text", "sys"),)),
        Message("user", (ContentPart("input_text", "hé"), ContentPart("refusal", "no"))),
        Reasoning("thinking"),
        FunctionCall("c1", "get", '{"a": 1}'),
        FunctionCallOutput("c1", "out"),
        Marker("compaction_trigger"),
    ),
    instructions="Be brief.",
    tools=(ToolSpec("get", {"type": "object", "properties": {"a": {"type": "integer"}}}, "Gets.", None), ToolSpec("read", namespace="fs", strict=False)),
    tool_choice=ToolChoice("auto", allowed=("get",)),
    parallel_tool_calls=False,
    max_tool_calls=2,
    text_format=TextFormat("json_schema", name="x", schema={"type": "object"}, strict=True),
    sampling=Sampling(temperature=0.3, top_p=0.5, top_logprobs=3, logprobs=True, seed=MAX_SEED, max_output_tokens=64, presence_penalty=-1, frequency_penalty=2),
    cache_key="k",
    raw_prompt=None,
)

BAD_SAMPLING = [
    ("seed", -1), ("seed", 1.5), ("seed", 2**70), ("seed", 2**63), ("seed", "x"), ("seed", True), ("seed", math.nan),
    ("max_output_tokens", 2**63), ("max_output_tokens", 0), ("max_output_tokens", "9"), ("max_output_tokens", 1.0),
    ("top_logprobs", 100), ("top_logprobs", -1), ("top_logprobs", 1.0), ("top_logprobs", True),
    ("temperature", 2.5), ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "hot"), ("temperature", True),
    ("top_p", 0), ("top_p", 1.5), ("top_p", math.nan),
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("logprobs", 1),
]  # fmt: skip


@pytest.mark.parametrize(("param", "value"), BAD_SAMPLING)
def test_bad_sampling_is_refused_at_construction_naming_the_param(param, value):
    with pytest.raises(InvalidParam) as caught:
        Sampling(**{param: value})
    assert caught.value.param == param
    assert caught.value.message.startswith(f"Invalid '{param}'") and "Error" not in caught.value.message


def test_sampling_bounds_are_inclusive_where_the_api_says_so():
    edge = Sampling(temperature=2, top_p=1, top_logprobs=20, seed=0, max_output_tokens=1, presence_penalty=-2, frequency_penalty=2)
    assert Sampling(seed=MAX_SEED).seed == MAX_SEED
    assert isinstance(edge.temperature, float) and edge.temperature == 2.0  # an integer is a number


def test_other_values_are_checked_too():
    with pytest.raises(InvalidParam, match="tool_choice"):
        ToolChoice("named")  # a named choice needs a name
    with pytest.raises(InvalidParam) as caught:
        TextFormat("json_schema")
    assert caught.value.param == "text.format.schema"
    with pytest.raises(InvalidParam) as caught:
        GenerateRequest("m", max_tool_calls=0)
    assert caught.value.param == "max_tool_calls"
    with pytest.raises(InvalidParam):
        ToolSpec("")
    with pytest.raises(InvalidParam):
        Message("robot")


@pytest.mark.parametrize("message", [Generate("r", "resp_r", FULL), CountTokens("r", FULL), Compact("r", FULL, keep_tokens=10, max_output_tokens=5)])
def test_every_request_message_round_trips(message):
    assert decode(encode(message)) == message


def test_defaults_round_trip_and_unset_keys_take_them():
    bare = GenerateRequest("m")
    assert GenerateRequest.from_wire(bare.to_wire()) == bare
    assert GenerateRequest.from_wire({"model": "m"}) == bare
    assert bare.sampling.max_output_tokens is None  # the worker's default applies


def test_unknown_keys_from_a_newer_peer_are_ignored():
    wire = FULL.to_wire()
    wire["future_field"] = {"x": 1}
    wire["sampling"] = {**wire["sampling"], "min_p": 0.1}
    wire["tools"] = [{**wire["tools"][0], "cache_control": "ephemeral"}, wire["tools"][1]]
    wire["tool_choice"] = {**wire["tool_choice"], "extra": True}
    frame = msgpack.packb({"t": "Generate", "req_id": "r", "response_id": "resp_r", "request": wire, "later": 1})
    assert decode(frame) == Generate("r", "resp_r", FULL)


@pytest.mark.parametrize(("param", "value"), [("seed", -1), ("seed", 1.5), ("seed", 2**63), ("seed", "x"), ("max_output_tokens", 0), ("top_logprobs", 100)])
def test_a_frame_with_a_bad_value_is_an_invalid_request_naming_it(param, value):
    wire = {**GenerateRequest("m").to_wire(), "sampling": {param: value}}
    frame = msgpack.packb({"t": "Generate", "req_id": "r9", "response_id": "resp", "request": wire})
    with pytest.raises(InvalidRequest) as caught:
        decode(frame)
    assert (caught.value.req_id, caught.value.param) == ("r9", param)
    assert caught.value.message.startswith(f"Invalid '{param}'")


@pytest.mark.parametrize("request_value", [5, {"model": "m", "input": 3}, {"model": "m", "tools": [1]}, {"model": "m", "input": [{"type": "message", "role": "user", "content": "not parts"}]}, {}])
def test_a_malformed_request_is_refused_on_decode(request_value):
    frame = msgpack.packb({"t": "CountTokens", "req_id": "r", "request": request_value})
    with pytest.raises(ProtocolError):
        decode(frame)


def test_tool_choice_from_the_api_shapes():
    assert [ToolChoice.from_api(api) for api in (None, "auto", "none", "required")] == [ToolChoice(), ToolChoice(), ToolChoice("none"), ToolChoice("required")]
    assert ToolChoice.from_api({"type": "function", "name": "f"}) == ToolChoice("named", name="f")
    assert ToolChoice.from_api({"type": "function", "function": {"name": "f"}}) == ToolChoice("named", name="f")  # the Chat shape
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}]}
    assert ToolChoice.from_api(allowed) == ToolChoice("required", allowed=("f", "g"))
    assert ToolChoice.from_api("required").forces_call and ToolChoice.from_api({"type": "function", "name": "f"}).forces_call
    assert ToolChoice.from_api(allowed).forces_call  # one of the subset, by the grammar
    assert not ToolChoice.from_api({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]}).forces_call
    assert not ToolChoice.from_api({"type": "allowed_tools", "mode": "required", "tools": []}).forces_call  # nothing to force


def test_request_derived_views():
    assert FULL.namespaces() == {"read": "fs"}
    assert not FULL.forces_call and FULL.offered_tools == FULL.tools
    silent = GenerateRequest("m", tools=FULL.tools, tool_choice=ToolChoice("none"))
    assert silent.offered_tools == () and not silent.forces_call
    assert GenerateRequest("m", tool_choice=ToolChoice("required")).forces_call is False  # no tools, nothing to force


@pytest.mark.parametrize("api", ["sometimes", 3, {"type": "allowed_tools", "tools": 5}, {"type": "function", "function": "f"}, {"type": "web_search"}])
def test_a_tool_choice_of_no_known_shape_is_invalid_not_a_crash(api):
    with pytest.raises(InvalidParam) as caught:
        ToolChoice.from_api(api)
    assert caught.value.param == "tool_choice"
