"""Gateway replicas sharing their state through Redis (``--store redis``; issue 18, item 2).

Two gateway apps in this process play two replicas behind a load balancer: each has its own
fake worker pool (``TalkingPool``, a scripted stand-in named as such) and they share only a Redis
namespace, as two gateway processes would. Every request goes to the replica the test names, so
"created on A, read on B" is exactly what a round-robin balancer does to a client.

The shared Redis is CI's (``KILN_TEST_REDIS_URL``), with a fresh namespace per test, dropped after.
The failure tests start a redis-server of their own and kill, stall and restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kiln.gateway.http.app import create_app
from kiln.gateway.settings import Settings
from kiln.protocol import Cancel, Done, Event, Generate, decode, encode
from kiln.protocol.request import Message
from kiln.protocol.usage import Usage
from tests.conformance import assert_error, assert_response, assert_stream
from tests.gateway.inprocess import ANSWER_BOUND_S, MODEL, FakePool, bounded
from tests.redis_support import RedisServer, drop_namespace, new_namespace, shared_redis_url

USAGE = Usage(input_tokens=5, output_tokens=3)


def _text(item: dict) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


class TalkingPool(FakePool):
    """The fake worker (scripted, named as such): it answers each generation with one message,
    ``seen N: <last user text>`` (N: the user messages it was given, so history shows), and
    never answers an input whose last user message is ``hold`` until it is cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set[str] = set()
        self.cancelled: set[str] = set()

    async def _send(self, identity: bytes, message: Any) -> None:
        message = decode(encode(message))
        if isinstance(message, Cancel):
            self.cancelled.add(message.req_id)
            return
        if not isinstance(message, Generate):
            return await super()._send(identity, message)
        users = [i for i in message.request.input if isinstance(i, Message) and i.role == "user"]
        last = users[-1].text if users else ""
        if last == "hold":
            self.held.add(message.req_id)
            return
        text = f"seen {len(users)}: {last}"
        item = {"type": "message", "id": f"msg_{message.req_id[-12:]}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
        events = [
            {"type": "response.output_item.added", "output_index": 0, "item": {**item, "status": "in_progress", "content": []}},
            {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "item_id": item["id"], "delta": text},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
        ]
        await self._dispatch(identity, Event(message.req_id, events, USAGE))
        await self._dispatch(identity, Done(message.req_id, "completed", USAGE))


class Replica:
    def __init__(self, app: Any, pool: TalkingPool) -> None:
        self.app, self.pool = app, pool
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=ANSWER_BOUND_S)

    @property
    def service(self) -> Any:
        return self.app.state.responses

    async def create(self, **body: Any) -> dict:
        r = await bounded(self.client.post("/v1/responses", json={"model": MODEL, **body}))
        assert r.status_code == 200, r.text
        return r.json()

    async def get(self, path: str, **kw: Any) -> httpx.Response:
        return await bounded(self.client.get(path, **kw))


@contextlib.asynccontextmanager
async def replicas(url: str, namespace: str, count: int = 2, **settings: Any) -> AsyncIterator[list[Replica]]:
    """``count`` gateway apps on one Redis namespace, their lifespans running."""
    stack = contextlib.AsyncExitStack()
    out = []
    async with stack:
        for _ in range(count):
            pool = TalkingPool()
            app = create_app(Settings(store_mode="redis", redis_url=url, redis_namespace=namespace, **settings), pool=pool)
            await stack.enter_async_context(app.router.lifespan_context(app))
            replica = Replica(app, pool)
            stack.push_async_callback(replica.client.aclose)
            # Listening for cancels before the test starts (instead of sleeping).
            await asyncio.wait_for(app.state.responses.stores.lifecycle.cancels.listening.wait(), ANSWER_BOUND_S)
            out.append(replica)
        yield out


@pytest.fixture
def shared():
    url = shared_redis_url()
    namespace = new_namespace()
    yield url, namespace
    drop_namespace(url, namespace)


async def _poll(replica: Replica, rid: str, until: frozenset[str] = frozenset({"completed", "incomplete", "failed", "cancelled"}), timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        obj = (await replica.get(f"/v1/responses/{rid}")).json()
        if obj.get("status") in until:
            return obj
        assert time.monotonic() < deadline, f"{rid} stayed {obj.get('status')}"
        await asyncio.sleep(0.02)


async def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


# -- one response, any replica -------------------------------------------------------------------

async def test_created_on_a_is_read_listed_and_deleted_on_b(shared):
    async with replicas(*shared) as (a, b):
        created = await a.create(input="hello", metadata={"k": "v"})
        got = await b.get(f"/v1/responses/{created['id']}")
        assert got.status_code == 200 and got.json() == created
        assert_response(got.json())
        items = (await b.get(f"/v1/responses/{created['id']}/input_items")).json()
        assert [_text(i) for i in items["data"]] == ["hello"]
        deleted = await bounded(b.client.delete(f"/v1/responses/{created['id']}"))
        assert deleted.json() == {"id": created["id"], "object": "response", "deleted": True}
        gone = await a.get(f"/v1/responses/{created['id']}")
        assert gone.status_code == 404
        assert_error(gone.json())
        assert (await bounded(a.client.delete(f"/v1/responses/{created['id']}"))).status_code == 404


async def test_previous_response_id_chain_alternates_replicas(shared):
    async with replicas(*shared) as (a, b):
        previous = None
        for turn in range(6):
            replica = (a, b)[turn % 2]
            body = {"input": f"turn {turn}"} | ({"previous_response_id": previous} if previous else {})
            response = await replica.create(**body)
            assert response["output"][0]["content"][0]["text"] == f"seen {turn + 1}: turn {turn}"
            previous = response["id"]
        items = (await a.get(f"/v1/responses/{previous}/input_items", params={"order": "asc", "limit": 100})).json()["data"]
        users = [_text(i) for i in items if i.get("role") == "user"]
        assert users == [f"turn {t}" for t in range(6)]
        # An item of a response stored through A is referenced through B.
        ref = await b.create(input=[{"type": "item_reference", "id": items[0]["id"]}])
        assert ref["output"][0]["content"][0]["text"] == "seen 1: turn 0"


async def test_conversation_written_from_both(shared):
    async with replicas(*shared) as (a, b):
        conv = (await bounded(a.client.post("/v1/conversations", json={"metadata": {"topic": "both"}, "items": [{"role": "user", "content": "first"}]}))).json()
        await b.create(input="on b", conversation=conv["id"])
        await a.create(input="on a", conversation=conv["id"])
        # Appends from both replicas at the same moment all land (RPUSH in one script each).
        adds = [r.client.post(f"/v1/conversations/{conv['id']}/items", json={"items": [{"role": "user", "content": f"note {i}"}]}) for i, r in enumerate((a, b) * 5)]
        results = await bounded(asyncio.gather(*adds))
        assert all(r.status_code == 200 for r in results)
        listed = (await b.get(f"/v1/conversations/{conv['id']}/items", params={"order": "asc", "limit": 100})).json()["data"]
        texts = [_text(i) for i in listed]
        assert texts[:5] == ["first", "on b", "seen 2: on b", "on a", "seen 3: on a"]
        assert sorted(texts[5:]) == sorted(f"note {i}" for i in range(10))
        assert (await a.get(f"/v1/conversations/{conv['id']}")).json()["metadata"] == {"topic": "both"}
        updated = await bounded(b.client.post(f"/v1/conversations/{conv['id']}", json={"metadata": {"topic": "changed"}}))
        assert updated.json()["metadata"] == {"topic": "changed"}
        item = listed[1]["id"]
        assert (await a.get(f"/v1/conversations/{conv['id']}/items/{item}")).json()["id"] == item
        assert (await bounded(b.client.delete(f"/v1/conversations/{conv['id']}/items/{item}"))).status_code == 200
        assert (await a.get(f"/v1/conversations/{conv['id']}/items/{item}")).status_code == 404
        assert (await bounded(a.client.delete(f"/v1/conversations/{conv['id']}"))).json()["deleted"] is True
        assert (await b.get(f"/v1/conversations/{conv['id']}")).status_code == 404


# -- background jobs across replicas ------------------------------------------------------------

async def test_background_job_created_on_a_is_polled_streamed_and_cancelled_on_b(shared):
    async with replicas(*shared) as (a, b):
        job = await a.create(input="hold", background=True)
        assert job["status"] == "queued"
        await _wait(lambda: a.pool.held)
        polled = await _poll(b, job["id"], until=frozenset({"in_progress"}))
        assert polled["output"] == [] and polled["background"] is True
        assert_response(polled, terminal=False)
        assert (await bounded(b.client.delete(f"/v1/responses/{job['id']}"))).status_code == 400  # still running
        chained = await bounded(b.client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": job["id"]}))
        assert chained.status_code == 400 and "has not finished" in chained.json()["error"]["message"]

        async def follow() -> list[dict]:
            r = await b.client.get(f"/v1/responses/{job['id']}", params={"stream": "true"})
            return _sse(r.text)

        streamed = asyncio.create_task(follow())
        cancelled = await bounded(b.client.post(f"/v1/responses/{job['id']}/cancel"))
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert_response(cancelled.json())
        assert a.pool.cancelled == a.pool.held  # the owner told its worker to stop
        assert a.service.stores.jobs.active == {}
        assert (await a.get(f"/v1/responses/{job['id']}")).json()["status"] == "cancelled"
        events = await bounded(streamed)
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
        assert events[-1]["response"]["status"] == "cancelled"
        assert_stream(events)


def _expired(answer: httpx.Response) -> bool:
    """A streamed retrieval refused because the stream itself is gone (not only its head)."""
    return answer.status_code == 400 and answer.json()["error"]["param"] == "stream"


async def test_finished_event_streams_are_bounded_in_bytes_across_replicas(shared):
    """Issue 30 item 5 on Redis: a stream beyond its byte bound loses its oldest events, and the
    finished streams together stay within theirs, the oldest dropped first (then read as expired)."""
    async with replicas(*shared) as (a, b):
        log = a.service.stores.events
        log.max_bytes, log.max_total_bytes = 250_000, 1_000_000
        heavy = {"input": "work", "instructions": "x" * 100_000, "background": True}
        ids = []
        for _ in range(6):  # each ~4 snapshots of 100 KB: trimmed to 250 KB, 6 > 1 MB in all
            ids.append((await a.create(**heavy))["id"])
            await _poll(b, ids[-1])
        # The finish scripts run after the events are written (asynchronously): until then the
        # oldest may answer as trimmed at its head (param "starting_after") rather than gone.
        deadline = time.monotonic() + 10
        while not _expired(oldest := await b.get(f"/v1/responses/{ids[0]}", params={"stream": "true"})):
            assert time.monotonic() < deadline, f"the oldest finished stream was kept beyond the byte bound: {oldest.text}"
            await asyncio.sleep(0.05)
        newest = await b.get(f"/v1/responses/{ids[-1]}", params={"stream": "true"})
        assert newest.status_code == 400 and newest.json()["error"]["param"] == "starting_after"  # its head was trimmed
        tail = _sse((await b.get(f"/v1/responses/{ids[-1]}", params={"stream": "true", "starting_after": "3"})).text)
        assert tail[-1]["type"] == "response.completed"


async def test_background_job_finishes_and_chains_from_the_other_replica(shared):
    async with replicas(*shared) as (a, b):
        job = await a.create(input="work", background=True)
        done = await _poll(b, job["id"])
        assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "seen 1: work"
        follow = await b.create(input="next", previous_response_id=job["id"])
        assert follow["output"][0]["content"][0]["text"] == "seen 2: next"
        replay = _sse((await b.get(f"/v1/responses/{job['id']}", params={"stream": "true", "starting_after": "1"})).text)
        assert replay[0]["sequence_number"] == 2 and replay[-1]["type"] == "response.completed"


async def test_owner_death_fails_its_jobs_within_the_lease(shared):
    lease = 2
    async with replicas(*shared, responses_background_lease_secs=lease) as (a, b):
        job = await a.create(input="hold", background=True)
        await _wait(lambda: a.pool.held)
        await a.service.stores.jobs.close()  # A stops renewing (and sweeping): as if it died
        stopped = time.monotonic()
        failed = await _poll(b, job["id"], until=frozenset({"failed"}), timeout=lease * 5)
        took = time.monotonic() - stopped
        assert failed["error"]["code"] == "server_error" and "stopped" in failed["error"]["message"]
        assert_response(failed)
        events = _sse((await b.get(f"/v1/responses/{job['id']}", params={"stream": "true"})).text)
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
        assert_stream(events)
        print(f"\nowner stopped renewing: job failed on the other replica {took:.2f}s later (lease {lease}s)")


async def test_shutdown_ends_the_replicas_jobs_at_once(shared):
    url, namespace = shared
    async with replicas(url, namespace, count=1) as (b,):
        async with replicas(url, namespace, count=1) as (a,):
            job = await a.create(input="hold", background=True)
            await _wait(lambda: a.pool.held)
        # A's lifespan ended (a rolling restart): its job is failed now, not after the lease.
        failed = (await b.get(f"/v1/responses/{job['id']}")).json()
        assert failed["status"] == "failed" and "shut down" in failed["error"]["message"]


async def test_foreground_response_is_seen_and_cancelled_from_the_other_replica(shared):
    async with replicas(*shared) as (a, b):
        async def stream_on_a() -> list[dict]:
            r = await a.client.post("/v1/responses", json={"model": MODEL, "input": "hold", "stream": True})
            return _sse(r.text)

        streaming = asyncio.create_task(stream_on_a())
        await _wait(lambda: a.service.inflight)
        rid = next(iter(a.service.inflight))
        seen = (await b.get(f"/v1/responses/{rid}")).json()
        assert seen["status"] == "in_progress"

        async def follow_on_b() -> list[dict]:  # streamed retrieval of A's live stream, from B
            r = await b.client.get(f"/v1/responses/{rid}", params={"stream": "true"})
            return _sse(r.text)

        followed = asyncio.create_task(follow_on_b())
        cancelled = await bounded(b.client.post(f"/v1/responses/{rid}/cancel"))
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        events = await bounded(streaming)
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "cancelled"
        assert_stream(events)
        assert [e["type"] for e in await bounded(followed)] == [e["type"] for e in events]
        assert (await b.get(f"/v1/responses/{rid}")).json()["status"] == "cancelled"


# -- the deployment's limits ----------------------------------------------------------------

async def test_limits_hold_across_replicas(shared):
    async with replicas(*shared, responses_background_max_jobs=2, responses_store_max_entries=3) as (a, b):
        jobs = [await a.create(input="hold", background=True), await b.create(input="hold", background=True)]
        for replica in (a, b):
            r = await bounded(replica.client.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True}))
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert_error(r.json())
        assert (await b.get("/health")).json()["stores"]["background"]["active"] == 2
        for job, owner in zip(jobs, (b, a), strict=False):
            assert (await bounded(owner.client.post(f"/v1/responses/{job['id']}/cancel"))).json()["status"] == "cancelled"
        # Three entries for the deployment: LRU over both replicas' writes (jobs' finals included).
        first = await a.create(input="one")
        await b.create(input="two")
        assert (await b.get(f"/v1/responses/{first['id']}")).status_code == 200  # a use: now the newest
        await a.create(input="three")
        for job in jobs:
            assert (await a.get(f"/v1/responses/{job['id']}")).status_code == 404  # least recently used
        assert (await a.get(f"/v1/responses/{first['id']}")).status_code == 200
        health = (await a.get("/health")).json()["stores"]
        assert health["backend"] == "redis" and health["responses"]["entries"] == 3


async def test_byte_budget_is_the_deployments(shared):
    async with replicas(*shared, responses_store_max_bytes=10_000) as (a, b):
        ids = [(await (a, b)[i % 2].create(input=f"{i} " + "x" * 1000))["id"] for i in range(8)]
        stats = (await a.get("/health")).json()["stores"]["responses"]
        assert stats["bytes"] <= 10_000 and 2 <= stats["entries"] < 8
        assert (await b.get(f"/v1/responses/{ids[-1]}")).status_code == 200
        assert (await b.get(f"/v1/responses/{ids[0]}")).status_code == 404  # the oldest, evicted by bytes


async def test_ttl_is_redis_expiry(shared):
    async with replicas(*shared, responses_store_ttl_secs=1) as (a, b):
        rid = (await a.create(input="short-lived"))["id"]
        deadline = time.monotonic() + 15
        while (await b.get(f"/v1/responses/{rid}")).status_code == 200:
            assert time.monotonic() < deadline, "never expired"
            await asyncio.sleep(0.1)
        ctx = a.service.stores.lifecycle.ctx
        assert not await ctx.redis.exists(ctx.keys.data(ctx.keys.responses, rid))
        # The expired entry's bookkeeping goes with the next write: the counts are the live ones.
        await b.create(input="next")
        stats = (await a.get("/health")).json()["stores"]["responses"]
        assert stats["entries"] <= 1  # not 2: the expired one no longer counts


async def test_maintenance_switch_is_shared(shared, tmp_path):
    from kiln.gateway.accounts.keys import create_key
    from kiln.gateway.accounts.orgs import create_org

    url, namespace = shared
    settings = {"auth": "keys", "database_url": f"sqlite:///{tmp_path}/accounts.db", "admin_token": "admin-secret"}
    async with replicas(url, namespace, **settings) as (a, b):
        await create_org(a.app.state.accounts.db, "acme", credits_usd=10)
        key = (await create_key(a.app.state.accounts.db, "acme")).key
        admin = {"Authorization": "Bearer admin-secret"}
        user = {"Authorization": f"Bearer {key}"}
        assert (await b.get("/v1/models", headers=user)).status_code == 200
        on = await bounded(a.client.post("/admin/maintenance", json={"on": True, "retry_after": 30}, headers=admin))
        assert on.json() == {"maintenance": True, "retry_after": 30}
        deadline = time.monotonic() + 10
        while (r := await b.get("/v1/models", headers=user)).status_code != 503:  # within a second
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert r.headers["retry-after"] == "30"
        assert_error(r.json())
        assert (await b.get("/admin/maintenance", headers=admin)).json()["maintenance"] is True
        await bounded(b.client.post("/admin/maintenance", json={"on": False}, headers=admin))
        deadline = time.monotonic() + 10
        while (await a.get("/v1/models", headers=user)).status_code != 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)


async def test_other_organizations_ids_are_unknown_on_every_replica(shared, tmp_path):
    from kiln.gateway.accounts.keys import create_key
    from kiln.gateway.accounts.orgs import create_org

    url, namespace = shared
    async with replicas(url, namespace, auth="keys", database_url=f"sqlite:///{tmp_path}/accounts.db") as (a, b):
        db = a.app.state.accounts.db
        keys = []
        for org in ("acme", "globex"):
            await create_org(db, org, credits_usd=10)
            keys.append({"Authorization": f"Bearer {(await create_key(db, org)).key}"})
        acme, globex = keys
        r = await bounded(a.client.post("/v1/responses", json={"model": MODEL, "input": "secret"}, headers=acme))
        rid = r.json()["id"]
        assert (await b.get(f"/v1/responses/{rid}", headers=acme)).status_code == 200
        for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
            assert (await b.get(path, headers=globex)).status_code == 404
        chained = await bounded(b.client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": rid}, headers=globex))
        assert chained.status_code == 400 and chained.json()["error"]["code"] == "previous_response_not_found"
        conv = (await bounded(a.client.post("/v1/conversations", json={}, headers=acme))).json()
        assert (await b.get(f"/v1/conversations/{conv['id']}", headers=globex)).status_code == 404
        assert (await b.get(f"/v1/conversations/{conv['id']}", headers=acme)).status_code == 200


# -- Redis down and back ----------------------------------------------------------------------

async def test_redis_down_is_503_and_recovery_needs_no_restart(tmp_path):
    server = RedisServer(tmp_path).start()
    namespace = new_namespace()
    try:
        async with replicas(server.url, namespace) as (a, b):
            kept = await a.create(input="acknowledged")
            conv = (await bounded(a.client.post("/v1/conversations", json={"items": [{"role": "user", "content": "kept too"}]}))).json()
            server.kill()
            started = time.monotonic()
            refusals = [
                await bounded(b.client.post("/v1/responses", json={"model": MODEL, "input": "x"})),
                await bounded(b.client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": kept["id"]})),
                await bounded(b.client.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True})),
                await b.get(f"/v1/responses/{kept['id']}"),
                await b.get(f"/v1/responses/{kept['id']}/input_items"),
                await bounded(b.client.delete(f"/v1/responses/{kept['id']}")),
                await b.get(f"/v1/conversations/{conv['id']}"),
                await bounded(b.client.post("/v1/responses", json={"model": MODEL, "input": "x", "conversation": conv["id"]})),
            ]
            for r in refusals:
                assert r.status_code == 503, r.text
                assert_error(r.json())
                assert r.headers.get("retry-after") and "unavailable" in r.json()["error"]["message"]
                assert "redis" not in r.text.lower() and "Traceback" not in r.text
            print(f"\nRedis killed: {len(refusals)} requests answered 503 in {time.monotonic() - started:.2f}s")
            # What needs no store still works; /health says the store is away.
            unstored = await bounded(b.client.post("/v1/responses", json={"model": MODEL, "input": "x", "store": False}))
            assert unstored.status_code == 200, unstored.text
            health = await b.get("/health")
            assert health.status_code == 200 and health.json()["stores"]["responses"] == {"available": False}

            server.start()  # same data directory: what Redis acknowledged is back
            assert (await b.get(f"/v1/responses/{kept['id']}")).json() == kept
            assert [_text(i) for i in (await a.get(f"/v1/conversations/{conv['id']}/items")).json()["data"]] == ["kept too"]
            again = await b.create(input="after", previous_response_id=kept["id"])
            assert again["output"][0]["content"][0]["text"] == "seen 2: after"
            job = await a.create(input="work", background=True)
            assert (await _poll(b, job["id"]))["status"] == "completed"
    finally:
        server.stop()


async def test_stalled_redis_is_503_within_the_socket_timeout(tmp_path):
    from kiln.gateway.store.redis.connection import SOCKET_TIMEOUT_S

    server = RedisServer(tmp_path).start()
    namespace = new_namespace()
    try:
        async with replicas(server.url, namespace, count=1) as (a,):
            kept = await a.create(input="before")
            server.pause()
            started = time.monotonic()
            r = await bounded(a.client.get(f"/v1/responses/{kept['id']}"))
            took = time.monotonic() - started
            assert r.status_code == 503
            assert_error(r.json())
            assert took < 3 * SOCKET_TIMEOUT_S  # bounded, never a hang
            server.resume()
            assert (await a.get(f"/v1/responses/{kept['id']}")).json() == kept
            print(f"\nstalled Redis: 503 after {took:.2f}s (socket timeout {SOCKET_TIMEOUT_S}s)")
    finally:
        server.stop()
