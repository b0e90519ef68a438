"""Issue 30's fuzzer findings, each a body (or query string) a door answered 5xx: every door
answers them 4xx in its own error shape (in process, fake worker)."""

from __future__ import annotations

import pytest

from tests.conformance import assert_error
from tests.gateway.inprocess import MODEL, bounded, client_for, hosted_app, local_app

USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]

CASES = [
    ("/v1/responses", {"model": MODEL, "input": "hi", "tool_choice": {"type": {"type": "function"}}}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "tool_choice": {"type": ["function"]}}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": ["f"]}}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "tools": [{"type": {"a": 1}, "name": "f"}]}),
    ("/v1/responses", {"model": MODEL, "input": [{**USER, "role": {"user": True}}]}),
    ("/v1/responses/compact", {"model": MODEL, "input": [{**USER, "role": ["user"]}]}),
    ("/v1/responses/compact", {"model": MODEL, "input": [{**USER, "type": [1]}]}),
    ("/v1/responses/input_tokens", {"model": MODEL, "input": [{**USER, "content": [{"type": {"a": 1}, "text": "x"}]}]}),
    ("/v1/conversations", {"items": [{"role": ["x"]}]}),
    ("/v1/conversations", {"items": [{"type": {"a": 1}}]}),
    ("/v1/conversations", {"items": [{**USER, "content": [{"type": {"a": 1}}]}]}),
    ("{conv}/items", {"items": [{**USER, "role": {"type": {"a": 1}}}]}),
]


@pytest.mark.parametrize(("path", "body"), CASES, ids=[f"{i}-{p.rsplit('/', 1)[-1]}" for i, (p, _) in enumerate(CASES)])
async def test_hostile_bodies_get_400_not_500(path, body):
    app, _ = local_app()
    async with client_for(app, raise_app_exceptions=False) as c:
        if path.startswith("{conv}"):
            conv = (await bounded(c.post("/v1/conversations", json={"items": [USER]}))).json()["id"]
            path = path.replace("{conv}", f"/v1/conversations/{conv}")
        r = await bounded(c.post(path, json=body))
    assert r.status_code == 400, r.text
    assert_error(r.json())


@pytest.mark.parametrize("query", ["model=%00", "model=a%00b", "after=%00", "model=" + "m" * 201])
async def test_hosted_usage_query_strings_are_validated(tmp_path, query):
    """PostgreSQL refuses a NUL in a text parameter (the fuzzer's 502): refused here first."""
    app, _, key = await hosted_app(tmp_path)
    try:
        async with client_for(app, raise_app_exceptions=False) as c:
            r = await bounded(c.get(f"/v1/usage?{query}", headers={"authorization": f"Bearer {key}"}))
            assert r.status_code == 400, r.text
            assert_error(r.json())
            assert r.json()["error"]["param"] == query.split("=")[0]
            assert (await bounded(c.get("/v1/usage?model=kiln-fake", headers={"authorization": f"Bearer {key}"}))).status_code == 200
    finally:
        await app.state.accounts.close()
