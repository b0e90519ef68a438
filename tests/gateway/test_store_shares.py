"""Per-organization shares of the stores (issue 30, tenants): one organization filling the
response store, the conversation store, the finished event streams (streamed retrieval) or the
reasoning echo evicts
its own oldest entries, never another's, in memory and in Redis (``--store redis``, the local
Redis: tests/redis_support.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kiln.gateway.accounts.keys import create_key
from kiln.gateway.accounts.orgs import create_org
from kiln.gateway.http.app import create_app
from kiln.gateway.settings import Settings
from kiln.gateway.store.reasoning_echo import MemoryReasoningEcho
from kiln.gateway.store.redis.connection import RedisContext
from kiln.gateway.store.redis.reasoning_echo import RedisReasoningEcho
from kiln.protocol import Done, Event, Generate, decode, encode
from kiln.protocol.usage import Usage
from tests.gateway.inprocess import MODEL, FakePool, bounded, client_for
from tests.redis_support import drop_namespace, new_namespace, shared_redis_url

LIMITS = dict(responses_store_max_entries=8, responses_store_max_bytes=64 << 10, conversation_store_max_entries=8, conversation_store_max_bytes=64 << 10)


@contextlib.asynccontextmanager
async def hosted(tmp_path, backend: str) -> AsyncIterator[tuple[Any, list[dict[str, str]]]]:
    """A hosted app on ``backend`` (its lifespan running) with organizations acme and globex:
    (client, [acme's headers, globex's headers])."""
    settings: dict[str, Any] = dict(auth="keys", database_url=f"sqlite:///{tmp_path}/accounts.db", store_mode=backend, **LIMITS)
    namespace = None
    if backend == "redis":
        namespace = new_namespace()
        settings.update(redis_url=shared_redis_url(), redis_namespace=namespace)
    app = create_app(Settings(**settings), pool=FakePool())
    try:
        async with app.router.lifespan_context(app):
            headers = []
            for org in ("acme", "globex"):
                await create_org(app.state.accounts.db, org, credits_usd=10)
                headers.append({"Authorization": f"Bearer {(await create_key(app.state.accounts.db, org)).key}"})
            async with client_for(app) as c:
                c.app = app  # type: ignore[attr-defined]
                yield c, headers
    finally:
        if namespace is not None:
            drop_namespace(settings["redis_url"], namespace)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_one_orgs_responses_never_evict_anothers(tmp_path, backend):
    async with hosted(tmp_path, backend) as (c, (acme, globex)):
        r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "keep me"}, headers=globex))
        assert r.status_code == 200, r.text
        mine = r.json()["id"]
        flood = []
        for i in range(30):  # far past the store's 8 entries and 64 KiB, and acme's quarter of them
            r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": f"flood {i} " + "x" * 3000}, headers=acme))
            assert r.status_code == 200, r.text
            flood.append(r.json()["id"])
        assert (await bounded(c.get(f"/v1/responses/{mine}", headers=globex))).status_code == 200
        # acme lost its own oldest, and keeps at most its share (a quarter of 8 entries).
        kept = [rid for rid in flood if (await bounded(c.get(f"/v1/responses/{rid}", headers=acme))).status_code == 200]
        assert kept == flood[-len(kept):] and 1 <= len(kept) <= 2, kept


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_one_orgs_conversations_never_evict_anothers(tmp_path, backend):
    async with hosted(tmp_path, backend) as (c, (acme, globex)):
        r = await bounded(c.post("/v1/conversations", json={"items": [{"role": "user", "content": "keep me"}]}, headers=globex))
        mine = r.json()["id"]
        flood = []
        for i in range(30):
            r = await bounded(c.post("/v1/conversations", json={"items": [{"role": "user", "content": f"flood {i} " + "x" * 3000}]}, headers=acme))
            assert r.status_code == 200, r.text
            flood.append(r.json()["id"])
        # Turns appended to acme's newest conversation grow it: still only acme's own go.
        for _ in range(10):
            r = await bounded(c.post("/v1/responses", json={"model": MODEL, "input": "y" * 2000, "conversation": flood[-1]}, headers=acme))
            assert r.status_code == 200, r.text
        assert (await bounded(c.get(f"/v1/conversations/{mine}/items", headers=globex))).status_code == 200
        assert (await bounded(c.get(f"/v1/conversations/{flood[0]}", headers=acme))).status_code == 404


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_conversation_larger_than_the_orgs_share_is_refused_saying_so(tmp_path, backend):
    async with hosted(tmp_path, backend) as (c, (acme, globex)):
        r = await bounded(c.post("/v1/conversations", json={"items": [{"role": "user", "content": "z" * (20 << 10)}]}, headers=acme))
        assert r.status_code == 400, r.text
        assert "organization's share" in r.json()["error"]["message"], r.text



async def _streamed(c, body: dict, headers: dict[str, str]) -> str:
    """A stored foreground stream to its end (hosted gateways record those for streamed
    retrieval; they run no background jobs); its response id."""
    r = await bounded(c.post("/v1/responses", json={**body, "stream": True}, headers=headers))
    assert r.status_code == 200, r.text
    return r.text.split('"id":"', 1)[1].split('"', 1)[0]


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_one_orgs_finished_streams_never_push_out_anothers(tmp_path, backend):
    async with hosted(tmp_path, backend) as (c, (acme, globex)):
        events = c.app.state.responses.stores.events
        events.max_finished, events.max_total_bytes = 8, 600_000
        mine = await _streamed(c, {"model": MODEL, "input": "keep me"}, globex)
        heavy = {"model": MODEL, "input": "work", "instructions": "x" * 50_000}
        flood = [await _streamed(c, heavy, acme) for _ in range(12)]  # each ~150 KB: past 600 KB in all, and acme's quarter
        deadline = time.monotonic() + 10  # Redis marks a stream finished just after its last event
        while (await bounded(c.get(f"/v1/responses/{flood[0]}", params={"stream": "true"}, headers=acme))).status_code == 200:
            assert time.monotonic() < deadline, "acme's oldest stream was kept past its share"
            await asyncio.sleep(0.05)
        kept = await bounded(c.get(f"/v1/responses/{mine}", params={"stream": "true"}, headers=globex))
        assert kept.status_code == 200 and "response.completed" in kept.text, kept.text[:300]


def _reply(n: int, thought: str) -> list[dict[str, Any]]:
    """A plain reply, [reasoning, message]: what the reasoning echo remembers."""
    reasoning = {"type": "reasoning", "id": f"rs_{n}", "summary": [], "content": [{"type": "reasoning_text", "text": thought}]}
    return [reasoning, {"type": "message", "id": f"msg_{n}", "role": "assistant", "content": [{"type": "output_text", "text": f"answer {n}"}]}]


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_one_orgs_reasoning_never_pushes_out_anothers_echo(backend):
    # The echo puts a turn's reasoning back when a client replays the turn without it; one
    # organization's long reasoning must not make another's replays miss (and re-prefill).
    namespace = None
    if backend == "memory":
        echo: Any = MemoryReasoningEcho(64 << 10)
    else:
        url, namespace = shared_redis_url(), new_namespace()
        ctx = RedisContext(url, namespace, "test")
        echo = RedisReasoningEcho(ctx, 64 << 10)
    try:
        await echo.remember(_reply(0, "globex thinks"), owner=2)
        for n in range(1, 40):  # ~8 KB each: 5x the store, 20x acme's quarter of it
            await echo.remember(_reply(n, "x" * 8000), owner=1)
        replay = [{"type": "message", "role": "user", "content": "q"}, _reply(0, "")[1]]
        restored = await echo.restore(replay, owner=2)
        assert [i["type"] for i in restored] == ["message", "reasoning", "message"] and restored[1]["id"] == "rs_0"
        assert len(await echo.restore([_reply(1, "")[1]], owner=1)) == 1  # acme's oldest went first
        assert len(await echo.restore([_reply(39, "")[1]], owner=1)) == 2  # its newest is kept
        assert len(await echo.restore(replay, owner=1)) == 2  # and no tenant reads another's
    finally:
        if namespace is not None:
            await ctx.close()
            drop_namespace(url, namespace)


class ReplyingPool(FakePool):
    """The fake worker, answering each generation with one output message (so that a turn has
    something to append to its conversation)."""

    async def _send(self, identity: bytes, message: Any) -> None:
        message = decode(encode(message))
        if not isinstance(message, Generate):
            return await super()._send(identity, message)
        item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "ok", "annotations": []}]}
        await self._dispatch(identity, Event(message.req_id, [{"type": "response.output_item.done", "output_index": 0, "item": item}]))
        await self._dispatch(identity, Done(message.req_id, "completed", Usage(input_tokens=3, output_tokens=1)))


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_items_that_would_take_a_conversation_past_the_orgs_share_are_refused_and_it_stays(tmp_path, backend):
    # Appended, the conversation would have been the entry its own organization's share evicts:
    # a 200, then a 404. Refused instead, with nothing written.
    async with hosted(tmp_path, backend) as (c, (acme, _)):
        conv = (await bounded(c.post("/v1/conversations", json={"items": [{"role": "user", "content": "a" * (10 << 10)}]}, headers=acme))).json()["id"]
        r = await bounded(c.post(f"/v1/conversations/{conv}/items", json={"items": [{"role": "user", "content": "b" * (8 << 10)}]}, headers=acme))
        assert r.status_code == 400 and r.json()["error"]["param"] == "items", r.text
        assert "organization's share of the conversation store (16384 bytes)" in r.json()["error"]["message"], r.text
        kept = await bounded(c.get(f"/v1/conversations/{conv}/items", headers=acme))
        assert kept.status_code == 200 and len(kept.json()["data"]) == 1, kept.text
        small = await bounded(c.post(f"/v1/conversations/{conv}/items", json={"items": [{"role": "user", "content": "c"}]}, headers=acme))
        assert small.status_code == 200, small.text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_turn_that_would_take_its_conversation_past_the_share_fails_and_the_conversation_stays(tmp_path, stream):
    settings = Settings(auth="keys", database_url=f"sqlite:///{tmp_path}/accounts.db", store_mode="memory", **LIMITS)
    app = create_app(settings, pool=ReplyingPool())
    async with app.router.lifespan_context(app):
        await create_org(app.state.accounts.db, "acme", credits_usd=10)
        acme = {"Authorization": f"Bearer {(await create_key(app.state.accounts.db, 'acme')).key}"}
        async with client_for(app) as c:
            conv = (await bounded(c.post("/v1/conversations", json={"items": [{"role": "user", "content": "a" * (10 << 10)}]}, headers=acme))).json()["id"]
            body = {"model": MODEL, "conversation": conv, "input": "b" * (8 << 10), "stream": stream}
            r = await bounded(c.post("/v1/responses", json=body, headers=acme))
            if stream:
                assert r.status_code == 200 and "response.failed" in r.text and "organization's share" in r.text, r.text[-600:]
            else:
                assert r.status_code == 400 and r.json()["error"]["param"] == "conversation", r.text
                assert "organization's share" in r.json()["error"]["message"], r.text
            kept = await bounded(c.get(f"/v1/conversations/{conv}/items", headers=acme))
            assert kept.status_code == 200 and len(kept.json()["data"]) == 1, kept.text
            ok = await bounded(c.post("/v1/responses", json={**body, "input": "short"}, headers=acme))
            assert ok.status_code == 200, ok.text[-600:]
            assert len((await bounded(c.get(f"/v1/conversations/{conv}/items", headers=acme))).json()["data"]) == 3
