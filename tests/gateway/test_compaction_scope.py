"""Compaction runs in the organization's prefix-cache scope, as its generations do (issue 30 A):
the summary's prompt is the organization's history, so it must never land in a scope another
organization's lookups reach (the shared scope of an unscoped request was one)."""

from __future__ import annotations

from kiln.gateway.accounts.keys import create_key
from kiln.gateway.accounts.orgs import create_org
from kiln.gateway.http.app import create_app
from kiln.gateway.settings import Settings
from kiln.protocol import Compact, Generate
from tests.gateway.inprocess import MODEL, bounded, client_for
from tests.gateway.test_worker_request import RecordingPool


async def test_compaction_carries_the_organizations_cache_scope(tmp_path):
    pool = RecordingPool()
    app = create_app(Settings(auth="keys", database_url=f"sqlite:///{tmp_path}/accounts.db", store_mode="none"), pool=pool)
    await app.state.accounts.open()
    try:
        keys = {}
        for org in ("alpha", "beta"):
            await create_org(app.state.accounts.db, org, credits_usd=10)
            keys[org] = (await create_key(app.state.accounts.db, org)).key
        scopes: dict[str, tuple] = {}
        async with client_for(app) as c:
            for org, key in keys.items():
                headers = {"authorization": f"Bearer {key}"}
                history = [{"role": "user", "content": f"{org}'s secret plan"}, {"role": "assistant", "content": "noted"}, {"role": "user", "content": "go on"}]
                r = await bounded(c.post("/v1/responses/compact", json={"model": MODEL, "input": history}, headers=headers))
                assert r.status_code == 200, r.text
                r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4}, headers=headers))
                assert r.status_code == 200, r.text
                compact, generate = pool.request(Compact), pool.request(Generate)
                scopes[org] = (compact.cache_scope, generate.cache_scope)
                pool.sent.clear()
        for org, (compact_scope, generate_scope) in scopes.items():
            assert compact_scope is not None and compact_scope == generate_scope, org
        assert scopes["alpha"][0] != scopes["beta"][0]
    finally:
        await app.state.accounts.close()
