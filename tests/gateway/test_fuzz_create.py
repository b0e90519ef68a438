"""Fuzzing the create body: whatever a client sends, the gateway answers below 500, within a bound,
and leaves nothing registered on a worker.

Bodies are built as raw JSON text, so that what ``json.dumps`` would never write (``NaN``,
integers past 64 bits, lone surrogate escapes, 100,000-deep nesting) is sent as a client could.
Each field gets valid-ish values, hostile ones and values of every wrong type. Runs in-process
against a fake worker pool (tests/gateway/inprocess.py); the CI variant is ~200 examples, the
``slow`` one several thousand.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.inprocess import MODEL, bounded, client_for, hosted_app, local_app

HOSTILE = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e999",
    "18446744073709551616",
    "9223372036854775808",
    "-9223372036854775809",
    "1" * 400,
    '"\\ud800"',
    '"a\\udfffb"',
    '{"\\udc00": 1}',
    "1.5",
    "-1",
    "0",
    "true",
    "null",
    '""',
    "[]",
    "{}",
]

_any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)  # surrogates too
_plain = st.none() | st.booleans() | st.integers() | st.floats() | _any_text
# json.dumps writes NaN/Infinity for such floats and huge integers as digits: what we want sent.
_json_value = st.recursive(_plain, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_any_text, inner, max_size=3), max_leaves=8).map(json.dumps)


def _deep(n: int, kind: str) -> str:
    if kind == "array":
        return "[" * n + "1" + "]" * n
    if kind == "object":
        return '{"a":' * n + "1" + "}" * n
    return '{"type": "array", "items": ' * n + '{"type": "string"}' + "}" * n


_deep_value = st.builds(_deep, st.sampled_from([2, 39, 41, 63, 64, 65, 500, 100_000]), st.sampled_from(["array", "object", "schema"]))
_raw_value = st.one_of(st.sampled_from(HOSTILE), _json_value, _deep_value)


def _dumps(strategy: st.SearchStrategy) -> st.SearchStrategy[str]:
    return strategy.map(lambda v: json.dumps(v, allow_nan=True))


# Values close to what the field takes, so that checks behind the type check are reached too.
_VALID_ISH: dict[str, st.SearchStrategy[str]] = {
    "model": _dumps(st.sampled_from([MODEL, "no-such-model", ""])),
    "input": st.one_of(
        _dumps(st.text(max_size=30)),
        st.builds(lambda role, content: json.dumps([{"type": "message", "role": role, "content": json.loads(content)}]), st.sampled_from(["user", "assistant", "system", "robot"]), _raw_value.filter(lambda v: len(v) < 2000)),
        st.builds(lambda part: '[{"role": "user", "content": [%s]}]' % part, _raw_value),
        st.builds(lambda text: '[{"role": "user", "content": [{"type": "input_text", "text": %s}]}]' % text, _raw_value),
        _dumps(st.just([{"type": "function_call_output", "call_id": "c", "output": "x"}])),
    ),
    "max_output_tokens": _dumps(st.integers(-5, 10_000) | st.sampled_from([2**31, 2**63 - 1])),
    "temperature": _dumps(st.floats(-1, 3) | st.integers(-1, 3)),
    "top_p": _dumps(st.floats(-1, 2)),
    "top_logprobs": _dumps(st.integers(-1, 25)),
    "seed": _dumps(st.integers(-5, 2**64) | st.floats()),
    "max_tool_calls": _dumps(st.integers(-1, 5)),
    "truncation": _dumps(st.sampled_from(["disabled", "auto", ""])),
    "stream": _dumps(st.sampled_from([True, False, "true", 1, 2])),
    "background": _dumps(st.sampled_from([False, True, "false"])),
    "store": _dumps(st.booleans()),
    "metadata": _dumps(st.dictionaries(st.text(max_size=70), st.text(max_size=5) | st.integers(), max_size=17)),
    "reasoning": st.builds(lambda v: '{"effort": %s, "summary": "auto"}' % v, _raw_value),
    "text": st.one_of(
        st.builds(lambda schema: '{"format": {"type": "json_schema", "name": "x", "schema": %s}}' % schema, _raw_value),
        st.builds(lambda v: '{"format": {"type": "text"}, "verbosity": %s}' % v, _raw_value),
    ),
    "tools": st.one_of(
        st.builds(lambda schema: '[{"type": "function", "name": "f", "parameters": %s}]' % schema, _raw_value),
        _dumps(st.just([{"type": "web_search"}])),
        st.builds(lambda name: '[{"type": "function", "name": %s}]' % name, _raw_value),
    ),
    "tool_choice": _dumps(st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}, {"type": "mystery"}])),
    "include": _dumps(st.lists(st.sampled_from(["reasoning.encrypted_content", "message.output_text.logprobs", "x"]), max_size=2)),
    "previous_response_id": _dumps(st.sampled_from(["resp_nope", ""])),
    "conversation": _dumps(st.sampled_from(["conv_1", {"id": "conv_2"}])),
    "prompt_cache_key": _dumps(st.text(max_size=10)),
    "context_management": st.builds(lambda n: '[{"type": "compaction", "compact_threshold": %s}]' % n, _raw_value),
    "instructions": _raw_value,
    "parallel_tool_calls": _dumps(st.booleans()),
    "user": _raw_value,
    "service_tier": _raw_value,
}
FIELDS = sorted(_VALID_ISH)

# Hostile bodies are large by design; hypothesis warns when it prints one.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")


@st.composite
def create_bodies(draw) -> bytes:
    """A raw create body: model and input usually present, a few more fields, each valid-ish,
    hostile or of any type; sometimes not an object at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(_raw_value).encode("utf-8", "surrogatepass")
    fields: dict[str, str] = {}
    if draw(st.integers(0, 9)):
        fields["model"] = json.dumps(MODEL)
    if draw(st.integers(0, 9)):
        fields["input"] = '"hi"'
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        fields[name] = draw(st.one_of(_VALID_ISH[name], _raw_value))
    text = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items()) + "}"
    return text.encode("utf-8", "surrogatepass")


class _Harness:
    """One app and one client on one event loop for every example of a test."""

    def __init__(self, app, pool, headers: dict[str, str]) -> None:
        self.app, self.pool, self.headers = app, pool, headers
        self.loop = asyncio.new_event_loop()
        self.client = client_for(app)

    def post(self, path: str, content: bytes):
        return self.loop.run_until_complete(bounded(self._post(path, content)))

    async def _post(self, path: str, content: bytes):
        response = await self.client.post(path, content=content, headers={"content-type": "application/json", **self.headers})
        jobs = [job.task for job in list(self.app.state.responses.stores.jobs.active.values()) if job.task is not None]
        if jobs:  # background jobs run on: let them end before looking for leaks
            await asyncio.gather(*jobs, return_exceptions=True)
        return response

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        accounts = self.app.state.accounts
        if accounts is not None:
            self.loop.run_until_complete(accounts.close())
        self.loop.close()


@pytest.fixture(scope="module")
def local():
    app, pool = local_app()
    harness = _Harness(app, pool, {})
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    loop = asyncio.new_event_loop()
    app, pool, key = loop.run_until_complete(hosted_app(tmp_path_factory.mktemp("fuzz-hosted")))
    loop.close()
    # The accounts engine was opened on another loop; reopen it on the harness's.
    harness = _Harness(app, pool, {"authorization": f"Bearer {key}"})
    harness.loop.run_until_complete(app.state.accounts.close())
    harness.loop.run_until_complete(app.state.accounts.open())
    yield harness
    harness.close()


def _check(harness: _Harness, path: str, body: bytes) -> None:
    r = harness.post(path, body)
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "Traceback" not in error["message"]
    elif "text/event-stream" in r.headers.get("content-type", ""):
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":  # Chat Completions' end sentinel
                json.loads(line[6:], parse_constant=lambda c: pytest.fail(f"{c} streamed back"))
    assert harness.pool.leaked() == [], body[:300]


_CI = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
_SLOW = settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))


@_CI
@given(body=create_bodies(), path=st.sampled_from(["/v1/responses", "/v1/responses", "/v1/responses/compact", "/v1/responses/input_tokens"]))
def test_no_body_reaches_a_5xx_or_a_hang(local, body, path):
    _check(local, path, body)


@pytest.mark.slow
@_SLOW
@given(body=create_bodies(), path=st.sampled_from(["/v1/responses", "/v1/responses/compact", "/v1/responses/input_tokens"]))
def test_no_body_reaches_a_5xx_or_a_hang_long(local, body, path):
    _check(local, path, body)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=create_bodies())
def test_hosted_no_body_reaches_a_5xx_or_a_hang(hosted, body):
    _check(hosted, "/v1/responses", body)
