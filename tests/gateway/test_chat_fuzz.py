"""Fuzzing the Chat Completions and legacy Completions bodies the way test_fuzz_create.py fuzzes
the Responses body: whatever a client sends, the answer is below 500 in the OpenAI error shape,
within a bound, and nothing stays registered on the (fake, in-process) worker."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.gateway.inprocess import MODEL
from tests.gateway.test_fuzz_create import _CI, _check, _dumps, _raw_value, local  # noqa: F401  (fixture)

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

_role = st.sampled_from(["user", "assistant", "system", "developer", "tool", "function", "robot"])
_CHAT: dict[str, st.SearchStrategy[str]] = {
    "messages": st.one_of(
        st.builds(lambda role, content: '[{"role": %s, "content": %s}]' % (json.dumps(role), content), _role, _raw_value),
        st.builds(lambda part: '[{"role": "user", "content": [%s]}]' % part, _raw_value),
        st.builds(lambda calls: '[{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": %s}]' % calls, _raw_value),
        st.builds(lambda fn: '[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": %s}]}, {"role": "tool", "tool_call_id": "c", "content": "r"}]' % fn, _raw_value),
        st.builds(lambda cid: '[{"role": "tool", "tool_call_id": %s, "content": "r"}]' % cid, _raw_value),
    ),
    "tools": st.one_of(
        st.builds(lambda schema: '[{"type": "function", "function": {"name": "f", "parameters": %s}}]' % schema, _raw_value),
        st.builds(lambda fn: '[{"type": "function", "function": %s}]' % fn, _raw_value),
        st.builds(lambda strict: '[{"type": "function", "function": {"name": "f", "strict": %s}}]' % strict, _raw_value),
    ),
    "tool_choice": st.one_of(_dumps(st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}}])), _raw_value),
    "response_format": st.one_of(
        st.builds(lambda schema: '{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}' % schema, _raw_value),
        st.builds(lambda spec: '{"type": "json_schema", "json_schema": %s}' % spec, _raw_value),
        _dumps(st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "xml"}])),
    ),
    "max_tokens": _dumps(st.integers(-5, 10_000) | st.sampled_from([2**31, 2**63 - 1])),
    "max_completion_tokens": _dumps(st.integers(-5, 10_000)),
    "stop": st.one_of(_dumps(st.lists(st.text(max_size=5), max_size=6)), _raw_value),
    "logprobs": _dumps(st.sampled_from([True, False, "true", 2])),
    "top_logprobs": _dumps(st.integers(-1, 25)),
    "n": _dumps(st.integers(-1, 3)),
    "stream": _dumps(st.sampled_from([True, False, "true", 2])),
    "stream_options": st.builds(lambda v: '{"include_usage": %s}' % v, _raw_value),
    "temperature": _dumps(st.floats(-1, 3)),
    "seed": _dumps(st.integers(-5, 2**64)),
    "reasoning_effort": _raw_value,
    "metadata": _raw_value,
    "parallel_tool_calls": _raw_value,
    "user": _raw_value,
    "prompt": st.one_of(_dumps(st.text(max_size=10)), _raw_value),
    "echo": _raw_value,
    "best_of": _raw_value,
}
FIELDS = sorted(_CHAT)


@st.composite
def chat_bodies(draw) -> bytes:
    if draw(st.integers(0, 19)) == 0:
        return draw(_raw_value).encode("utf-8", "surrogatepass")
    fields: dict[str, str] = {}
    if draw(st.integers(0, 9)):
        fields["model"] = json.dumps(MODEL)
    if draw(st.integers(0, 9)):
        fields["messages"] = '[{"role": "user", "content": "hi"}]'
        fields["prompt"] = '"hi"'
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        fields[name] = draw(st.one_of(_CHAT[name], _raw_value))
    text = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items()) + "}"
    return text.encode("utf-8", "surrogatepass")


@_CI
@given(body=chat_bodies(), path=st.sampled_from(["/v1/chat/completions", "/v1/chat/completions", "/v1/completions"]))
def test_no_chat_body_reaches_a_5xx_or_a_hang(local, body, path):  # noqa: F811
    _check(local, path, body)
