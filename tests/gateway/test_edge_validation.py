"""No client input reaches a 5xx or a hang: each reproduced defect of the hardening issue answers
400 ``invalid_request_error`` naming the parameter, and leaves no request registered on a worker.

The parser is tested directly (kiln.gateway.http.body), the routes in-process against a fake worker
pool (tests/gateway/inprocess.py), local and hosted (``--auth keys``) mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.gateway.http.body import MAX_DEPTH, depth_within, parse_json_bytes
from kiln.gateway.http.errors import ApiError
from kiln.gateway.doors.schema_check import MAX_SCHEMA_DEPTH, check_json_schema
from tests.conformance import assert_error
from tests.gateway.inprocess import CONTEXT_WINDOW, MODEL, bounded, client_for, hosted_app, local_app

JSON = {"content-type": "application/json"}


def _refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_json_bytes(raw)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def _nested(n: int, inner: str = "1") -> str:
    return "[" * n + inner + "]" * n


# -- the parser ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"a": NaN}', "a"),
        (b'{"a": [1, Infinity]}', "a[1]"),
        (b'{"a": {"b": -Infinity}}', "a.b"),
        (b'{"user": 18446744073709551616}', "user"),
        (b'{"a": 9223372036854775808}', "a"),
        (b'{"a": -9223372036854775809}', "a"),
        (b'{"a": 1e400}', "a"),
        (b'{"a": -1E+999}', "a"),
        (b'{"a": ' + b"7" * 5000 + b"}", "a"),
        (b'{"input": "\\ud800"}', "input"),
        (b'{"input": [{"content": "x \\udfff y"}]}', "input[0].content"),
        (b'{"input": "\\ud83d\\ud83d\\ude00"}', "input"),
        (b'{"input": "\\\\\\ud800"}', "input"),
        (b'{"metadata": {"\\udc00": "v"}}', "metadata"),
    ],
)
def test_values_json_or_msgpack_cannot_carry_are_400_naming_the_place(raw, param):
    err = _refused(raw)
    assert err.param == param
    assert "Traceback" not in err.message and "Error" not in err.message


@pytest.mark.parametrize(
    "raw",
    [
        _nested(100_000).encode(),
        ('{"a":' * 100_000 + "1" + "}" * 100_000).encode(),
        _nested(MAX_DEPTH + 1).encode(),
        b"[" * 100_000,  # unterminated as well
    ],
    ids=["arrays-100k", "objects-100k", "one-past-the-bound", "unterminated"],
)
def test_deep_nesting_is_400_not_a_recursion(raw):
    assert "deeper than" in _refused(raw).message or "parse" in _refused(raw).message


@pytest.mark.parametrize(
    "raw, value",
    [
        (b'{"a": 9223372036854775807, "b": -9223372036854775808}', {"a": (1 << 63) - 1, "b": -(1 << 63)}),
        (b'{"a": 1e308, "b": 1e-400}', {"a": 1e308, "b": 0.0}),
        (b'{"a": "\\ud83d\\ude00"}', {"a": "\U0001F600"}),
        (b'{"a": "\\\\ud800"}', {"a": "\\ud800"}),  # an escaped backslash: plain text, not an escape
        (b'{"a": "[[[[{{{{\\"]]"}', {"a": '[[[[{{{{"]]'}),
        (_nested(MAX_DEPTH - 1, "[]").encode(), json.loads(_nested(MAX_DEPTH - 1, "[]"))),
        ('{"a": "é ✓"}'.encode("utf-16"), {"a": "é ✓"}),
    ],
    ids=["int64-bounds", "finite-floats", "surrogate-pair", "escaped-backslash", "brackets-in-strings", "at-the-bound", "utf-16"],
)
def test_what_json_allows_still_parses(raw, value):
    assert parse_json_bytes(raw) == value


def test_invalid_utf8_and_malformed_json_are_400_without_python_text():
    assert "UTF-8" in _refused(b'{"a": "\xed\xa0\x80"}').message  # a surrogate encoded in UTF-8
    message = _refused(b'{"model": ').message
    assert "line 1" in message and "Expecting" not in message


def test_one_long_string_is_fine():
    body = json.dumps({"model": MODEL, "input": "x" * (20 << 20)}).encode()
    assert len(parse_json_bytes(body)["input"]) == 20 << 20


def _reference_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_reference_depth, value), default=0)
    return 0


_tricky_text = st.text(alphabet=st.sampled_from('[]{}"\\ab\n\u00e9\U0001F600'), max_size=12)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | _tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_tricky_text, inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_json_values, wraps=st.integers(0, 80), limit=st.sampled_from([1, 3, 8, MAX_DEPTH]), ascii_only=st.booleans())
def test_depth_scan_agrees_with_the_real_depth(value, wraps, limit, ascii_only):
    for i in range(wraps):
        value = [value] if i % 2 else {"k[\\\"": value}
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert depth_within(raw, limit) == (_reference_depth(value) <= limit)


# -- schemas ---------------------------------------------------------------------------------------


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("levels", [MAX_SCHEMA_DEPTH + 1, 5000])
def test_too_deep_schema_is_400_even_built_in_code(levels):
    with pytest.raises(ApiError) as info:
        check_json_schema(_deep_schema(levels), param="tools[0].parameters")
    assert info.value.status == 400 and info.value.param == "tools[0].parameters"


def test_schema_at_the_bound_passes():
    check_json_schema(_deep_schema(MAX_SCHEMA_DEPTH), param="tools[0].parameters")


# -- the routes, local mode ------------------------------------------------------------------------


@pytest.fixture
async def local():
    app, pool = local_app()
    async with client_for(app) as client:
        yield client, pool


def _body(**fields) -> dict:
    return {"model": MODEL, "input": "hi", **fields}


def _raw(fields: str) -> bytes:
    return ('{"model": "%s", "input": "hi", %s}' % (MODEL, fields)).encode()


async def _assert_400(client, pool, content: bytes, param: str | None, path: str = "/v1/responses"):
    r = await bounded(client.post(path, content=content, headers=JSON))
    assert r.status_code == 400, r.text
    assert_error(r.json())
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] == param
    assert pool.leaked() == []
    return r.json()["error"]


_DEEP_TOOL = json.dumps({"type": "function", "name": "f", "parameters": _deep_schema(50)})
_DEEP_FORMAT = json.dumps({"format": {"type": "json_schema", "name": "x", "schema": _deep_schema(50)}})


@pytest.mark.parametrize(
    "fields, param",
    [
        ('"user": 18446744073709551616', "user"),
        ('"metadata": {"k": "v"}, "prompt_cache_key": "a", "service_tier": 99999999999999999999999', "service_tier"),
        ('"input": "\\ud800"', "input"),
        ('"reasoning": {"effort": NaN}', "reasoning.effort"),
        ('"text": {"verbosity": Infinity}', "text.verbosity"),
        ('"max_output_tokens": 9223372036854775808', "max_output_tokens"),
        ('"max_output_tokens": 9223372036854775807', "max_output_tokens"),
        ('"max_output_tokens": %d' % (CONTEXT_WINDOW + 1), "max_output_tokens"),
        ('"max_output_tokens": true', "max_output_tokens"),
        ('"seed": -1', "seed"),
        ('"seed": 1.5', "seed"),
        ('"seed": 1180591620717411303424', "seed"),
        ('"seed": "x"', "seed"),
        ('"seed": true', "seed"),
        ('"max_tool_calls": 0', "max_tool_calls"),
        ('"top_logprobs": false', "top_logprobs"),
        ('"temperature": true', "temperature"),
        ('"tools": [%s]' % _DEEP_TOOL, "tools[0].parameters"),
        ('"text": %s' % _DEEP_FORMAT, "text.format.schema"),
        ('"tools": [{"type": "function", "name": "f", "parameters": %s}]' % ('{"a":' * 5000 + "1" + "}" * 5000), None),
        ('"input": %s' % _nested(100_000, '"x"'), None),
    ],
)
async def test_reproduced_defects_are_400(local, fields, param):
    client, pool = local
    await _assert_400(client, pool, _raw(fields), param)


async def test_in_range_values_are_served(local):
    client, pool = local
    r = await bounded(client.post("/v1/responses", json=_body(seed=(1 << 63) - 1, max_output_tokens=CONTEXT_WINDOW, max_tool_calls=1, top_logprobs=20, temperature=0, top_p=1)))
    assert r.status_code == 200, r.text
    assert pool.leaked() == []


async def test_nothing_invalid_is_streamed_back(local):
    """NaN used to be echoed into the stream as ``NaN``, which no JSON parser reads."""
    client, pool = local
    await _assert_400(client, pool, _raw('"stream": true, "reasoning": {"effort": NaN}'), "reasoning.effort")
    r = await bounded(client.post("/v1/responses", json=_body(stream=True, reasoning={"effort": "low"}, seed=3)))
    frames = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert frames and all(json.loads(f, parse_constant=pytest.fail) for f in frames)


@pytest.mark.parametrize(
    "fields, param",
    [
        ('"user": 18446744073709551616', "user"),
        ('"input": [{"role": "user", "content": "\\udc00"}]', "input[0].content"),
        ('"max_output_tokens": true', "max_output_tokens"),
        ('"max_output_tokens": 20000', "max_output_tokens"),
        ('"keep_tokens": NaN', "keep_tokens"),
        ('"input": %s' % _nested(100_000), None),
    ],
)
async def test_compact_route_parses_the_same_way(local, fields, param):
    client, pool = local
    await _assert_400(client, pool, _raw(fields), param, path="/v1/responses/compact")


# -- hosted mode: /v1/usage, /admin/maintenance, and the create path through the middleware -------


@pytest.fixture
async def hosted(tmp_path):
    app, pool, key = await hosted_app(tmp_path, admin_token="admin-secret")
    try:
        async with client_for(app) as client:
            yield client, pool, {"authorization": f"Bearer {key}"}
    finally:
        await app.state.accounts.close()


@pytest.mark.parametrize(
    "query, param",
    [
        ("start_time=100000000000000000000", "start_time"),
        ("start_time=1e20", "start_time"),
        ("start_time=-1", "start_time"),
        ("end_time=253402300800", "end_time"),
        ("end_time=" + "9" * 5000, "end_time"),
        ("end_time=soon", "end_time"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=-5", "limit"),
    ],
)
async def test_usage_query_out_of_range_is_400(hosted, query, param):
    client, _, auth = hosted
    r = await bounded(client.get("/v1/usage?" + query, headers=auth))
    assert r.status_code == 400, r.text
    assert_error(r.json())
    assert r.json()["error"]["param"] == param


async def test_usage_query_in_range_is_served(hosted):
    client, _, auth = hosted
    r = await bounded(client.get("/v1/usage?start_time=0&end_time=253402300799&limit=1000", headers=auth))
    assert r.status_code == 200 and r.json()["object"] == "list"


@pytest.mark.parametrize("retry_after", [0, -1, 86401, 10**18, 1.5, "60", True])
async def test_maintenance_retry_after_is_bounded(hosted, retry_after):
    client, _, _ = hosted
    admin = {"authorization": "Bearer admin-secret"}
    r = await bounded(client.post("/admin/maintenance", json={"on": True, "retry_after": retry_after}, headers=admin))
    assert r.status_code == 400 and r.json()["error"]["param"] == "retry_after"
    assert (await client.get("/admin/maintenance", headers=admin)).json()["maintenance"] is False


async def test_maintenance_retry_after_at_the_bounds(hosted):
    client, _, _ = hosted
    admin = {"authorization": "Bearer admin-secret"}
    for seconds in (1, 86400):
        r = await bounded(client.post("/admin/maintenance", json={"on": False, "retry_after": seconds}, headers=admin))
        assert r.status_code == 200 and r.json()["retry_after"] == seconds


@pytest.mark.parametrize(
    "fields, param",
    [
        ('"user": 18446744073709551616', "user"),
        ('"input": "\\ud800"', "input"),
        ('"reasoning": {"effort": NaN}', "reasoning.effort"),
        ('"seed": -1', "seed"),
        pytest.param('"input": %s' % _nested(100_000), None, id="deep-100k"),
        pytest.param('"tools": [{"type": "function", "name": "f", "parameters": %s}]' % ('{"a":' * 5000 + "1" + "}" * 5000), None, id="deep-schema-5000"),
    ],
)
async def test_hosted_create_refuses_the_same_bodies(hosted, fields, param):
    client, pool, auth = hosted
    r = await bounded(client.post("/v1/responses", content=_raw(fields), headers={**auth, **JSON}))
    assert r.status_code == 400, r.text
    assert_error(r.json())
    assert r.json()["error"]["param"] == param
    assert pool.leaked() == []


# -- real bodies still pass ------------------------------------------------------------------------

DATA = Path(__file__).resolve().parents[1] / "data"


async def test_codex_capture_and_every_data_schema_still_pass():
    """The bounds leave room for real traffic: Codex's captured request, and each of the 50 data
    schemas as ``text.format`` and as a tool's ``parameters``."""
    app, pool = local_app(hosted_tools="drop")
    async with client_for(app) as client:
        codex = dict(json.loads((DATA / "codex-0.169-request.json").read_text())["body"], model=MODEL)
        r = await bounded(client.post("/v1/responses", json=codex))
        assert r.status_code == 200, r.text
        for path in sorted((DATA / "schemas").glob("*.json")):
            case = json.loads(path.read_text())
            fmt = {"format": {"type": "json_schema", "name": case["name"], "schema": case["schema"], "strict": True}}
            tool = {"type": "function", "name": case["name"], "parameters": case["schema"]}
            for fields in ({"text": fmt}, {"tools": [tool]}):
                r = await bounded(client.post("/v1/responses", json=_body(**fields)))
                assert r.status_code == 200, (path.name, r.text)
    assert pool.leaked() == []
