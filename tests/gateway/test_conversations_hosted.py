"""In hosted mode with the store on, conversations and item references are per organization:
another organization's ids are unknown to it (404 / 400), never readable (issue 15)."""

from __future__ import annotations

import pytest

from kiln.gateway.http.app import create_app
from kiln.gateway.settings import Settings
from tests.conformance import assert_error
from tests.gateway.inprocess import MODEL, FakePool, bounded, client_for


async def two_orgs(tmp_path, **settings):
    """A hosted app (the accounts open) with organizations acme and globex, $10 each, and a key
    for each: (app, [acme's key, globex's key])."""
    from kiln.gateway.accounts.keys import create_key
    from kiln.gateway.accounts.orgs import create_org

    app = create_app(Settings(auth="keys", database_url=f"sqlite:///{tmp_path}/accounts.db", **settings), pool=FakePool())
    await app.state.accounts.open()
    keys = []
    for org in ("acme", "globex"):
        await create_org(app.state.accounts.db, org, credits_usd=10)
        keys.append((await create_key(app.state.accounts.db, org)).key)
    return app, keys


@pytest.fixture
async def hosted(tmp_path):
    app, keys = await two_orgs(tmp_path, store_mode="memory", admin_token="admin-secret")
    try:
        yield app, keys
    finally:
        await app.state.accounts.close()


async def test_references_and_conversations_stay_in_their_organization(hosted):
    app, (acme, globex) = hosted
    a = {"Authorization": f"Bearer {acme}"}
    g = {"Authorization": f"Bearer {globex}"}
    async with client_for(app) as c:
        r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "secret plan"}, headers=a))
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        items = (await bounded(c.get(f"/v1/responses/{rid}/input_items", headers=a))).json()["data"]
        ref = {"model": MODEL, "input": [{"type": "item_reference", "id": items[0]["id"]}]}
        assert (await bounded(c.post("/v1/responses", json=ref, headers=a))).status_code == 200
        foreign = await bounded(c.post("/v1/responses", json=ref, headers=g))
        assert foreign.status_code == 400 and items[0]["id"] in foreign.json()["error"]["message"]
        assert_error(foreign.json())

        conv = (await bounded(c.post("/v1/conversations", json={"items": [{"role": "user", "content": "hi"}]}, headers=a))).json()
        assert (await bounded(c.get(f"/v1/conversations/{conv['id']}", headers=a))).status_code == 200
        for method, path in (("GET", ""), ("GET", "/items"), ("DELETE", "")):
            r = await bounded(c.request(method, f"/v1/conversations/{conv['id']}{path}", headers=g))
            assert r.status_code == 404, (method, path, r.text)
        conv_item = (await bounded(c.get(f"/v1/conversations/{conv['id']}/items", headers=a))).json()["data"][0]
        ref = {"model": MODEL, "input": [{"type": "item_reference", "id": conv_item["id"]}]}
        assert (await bounded(c.post("/v1/responses", json=ref, headers=g))).status_code == 400
        assert (await bounded(c.post("/v1/responses", json=ref, headers=a))).status_code == 200
        assert (await bounded(c.post("/v1/conversations", json={}))).status_code == 401


async def test_store_none_has_no_conversations(tmp_path):
    app = create_app(Settings(store_mode="none"), pool=FakePool())
    async with client_for(app) as c:
        r = await bounded(c.post("/v1/conversations", json={}))
    assert r.status_code == 404
    assert_error(r.json())


async def test_hosted_store_none_keeps_no_transcript_for_another_org_to_reach(tmp_path):
    """Issue 30 D: with --store none a `conversation` is refused as `previous_response_id` is, so
    no transcript of an organization's prompts is kept, and none can be read or wiped by another."""
    from kiln.gateway.lifecycle.history import conversation_key

    app, keys = await two_orgs(tmp_path, store_mode="none")
    accounts = app.state.accounts
    a, g = ({"Authorization": f"Bearer {k}"} for k in keys)
    try:
        async with client_for(app) as c:
            r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "the merger closes Friday", "conversation": "conv_plan"}, headers=a))
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter" and r.json()["error"]["param"] == "conversation", r.text
            assert_error(r.json())
            org_id = (await accounts.auth.authenticate(f"Bearer {keys[0]}", None, require_credits=False)).org_id
            assert await app.state.responses.stores.conversations.get(conversation_key("conv_plan", org_id)) is None
            assert (await bounded(c.delete("/v1/conversations/conv_plan", headers=g))).status_code == 404
            assert (await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi", "conversation": "conv_plan"}, headers=g))).status_code == 400
            assert (await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=a))).status_code == 200
    finally:
        await accounts.close()


async def test_one_orgs_conversations_never_evict_anothers(tmp_path):
    """Issue 30 tenants 3: an organization creating conversations far past its share of the store
    loses its own oldest; another organization's conversation is still there (it was evicted: 404)."""
    app, keys = await two_orgs(tmp_path, store_mode="memory", conversation_store_max_entries=8, conversation_store_max_bytes=64 << 10)
    accounts = app.state.accounts
    a, g = ({"Authorization": f"Bearer {k}"} for k in keys)
    try:
        async with client_for(app) as c:
            mine = (await bounded(c.post("/v1/conversations", json={"items": [{"role": "user", "content": "keep me"}]}, headers=g))).json()["id"]
            for i in range(40):
                r = await bounded(c.post("/v1/conversations", json={"items": [{"role": "user", "content": f"flood {i} " + "x" * 1000}]}, headers=a))
                assert r.status_code == 200, r.text
            assert (await bounded(c.get(f"/v1/conversations/{mine}", headers=g))).status_code == 200
    finally:
        await accounts.close()
