"""/v1/chat/completions in hosted mode (spec/hosted-gateway.md) against real processes with the
scripted worker (named as such): authenticated, admitted, limited and metered exactly like
/v1/responses, with one ledger row per request that equals what the client was shown.

Shares the helpers of test_hosted_gateway.py; a gateway of its own.
"""

from __future__ import annotations

import asyncio
import json
import random
from decimal import Decimal

import httpx
import pytest

from kiln.gateway.accounts.money import usd_to_nanos
from tests.conformance import assert_component, assert_error
from tests.e2e.test_hosted_gateway import (
    ADMIN_TOKEN,
    CATALOG,
    MODEL,
    REPLY,
    auth,
    credits_nanos,
    eventually_status,
    gen_id,
    ledger,
    new_org,
    parallel,
    run,
    start_hosted,
)

PATHS = ("/v1/chat/completions", "/chat/completions")
HI = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat-hosted")
    url = f"sqlite:///{tmp}/kiln.db"
    acme = new_org(url, "acme", credits="100", concurrency=64)  # first, alone: it creates the schema
    started = parallel(
        server=lambda: start_hosted(tmp, url),
        small=lambda: new_org(url, "small", concurrency=2),
        broke=lambda: new_org(url, "broke", credits="0"),
    )
    server = started.pop("server")
    server.db_url = url
    server.keys = {"acme": acme, **started}
    yield server
    server.stop()


def chat_cost(usage: dict) -> int:
    """Nano-USD for a chat usage, at catalog prices."""
    return usd_to_nanos(CATALOG.cost(MODEL, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]))


def short(**extra) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 4, **extra}


def test_401_402_on_both_paths(hosted):
    with httpx.Client(base_url=hosted.base_url, timeout=60) as c:
        for path in PATHS:
            for headers in ({}, {"Authorization": "Bearer sk-kiln-nonsense"}):
                r = c.post(path, json=short(), headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
                assert_error(r.json())
                gen_id(r)
            r = c.post(path, json=short(), headers=auth(hosted.keys["broke"]))
            assert r.status_code == 402 and r.json()["error"]["code"] == "insufficient_quota", r.text
            assert_error(r.json())


def test_429_and_slot_release(hosted):
    key = hosted.keys["small"]  # concurrency 2
    body = {"model": MODEL, "messages": HI, "stream": True}
    with httpx.Client(base_url=hosted.base_url, timeout=60) as c:
        with c.stream("POST", PATHS[0], json=body, headers=auth(key)) as s1, c.stream("POST", PATHS[1], json=body, headers=auth(key)) as s2:
            assert s1.status_code == s2.status_code == 200
            r = c.post(PATHS[0], json=short(), headers=auth(key))
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
            assert_error(r.json())
        assert eventually_status(lambda: c.post(PATHS[0], json=short(), headers=auth(key))).status_code == 200


def test_cost_on_non_streaming_body_and_one_ledger_row(hosted):
    with httpx.Client(base_url=hosted.base_url, timeout=60) as c:
        r = c.post(PATHS[0], json={"model": MODEL, "messages": HI}, headers=auth(hosted.keys["acme"]))
        assert r.status_code == 200, r.text
        body = r.json()
        assert_component(body, "CreateChatCompletionResponse")
        row = ledger(hosted.db_url)[gen_id(r)]
        assert row["status"] == "completed" and row["output_tokens"] == body["usage"]["completion_tokens"] == len(REPLY)
        assert usd_to_nanos(body["usage"]["cost"]) == chat_cost(body["usage"]) == row["cost_nanousd"] > 0
        metrics = c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).text
        assert 'kiln_requests_total{route="/v1/chat/completions",status="200"}' in metrics


async def _call(c: httpx.AsyncClient, key: str, path: str, body: dict) -> dict:
    """One chat call; what the client saw: status, generation id, usage, cost."""
    if not body.get("stream"):
        r = await c.post(path, json=body, headers=auth(key))
        usage = r.json()["usage"] if r.status_code == 200 else None
        return {"status": r.status_code, "gen": gen_id(r), "usage": usage, "cost": usage.get("cost") if usage else None}
    usage = None
    async with c.stream("POST", path, json=body, headers=auth(key)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
        return {"status": r.status_code, "gen": gen_id(r), "usage": usage, "cost": None}


def test_two_hundred_mixed_requests_reconcile(hosted):
    """Streamed and not, with and without /v1, stop-cut, truncated, legacy completions among them."""
    key, url = hosted.keys["acme"], hosted.db_url
    before = credits_nanos(url, "acme")
    rng = random.Random(17)
    bodies = []
    for i in range(200):
        body: dict = {"model": MODEL, "messages": [{"role": "system", "content": "s" * rng.randint(0, 40)}, {"role": "user", "content": "x" * rng.randint(1, 200)}], "max_tokens": rng.randint(1, 40)}
        if i % 2 == 0:
            body.update(stream=True, stream_options={"include_usage": True})
        if i % 5 == 0:
            body["stop"] = rng.choice(["hosted", "test", "Kiln", "zzz"])  # some hit, some never do
        path = PATHS[i % 3 == 0]
        if i % 7 == 3:  # a legacy completion now and then: the same door machinery, a raw prompt
            path = "/v1/completions"
            body["prompt"] = body.pop("messages")[1]["content"]
        bodies.append((path, body))

    async def go():
        sem = asyncio.Semaphore(24)
        async with httpx.AsyncClient(base_url=hosted.base_url, timeout=60) as c:
            async def one(path, body):
                async with sem:
                    return await _call(c, key, path, body)
            return await asyncio.gather(*(one(p, b) for p, b in bodies))

    results = run(go())
    assert [r["status"] for r in results] == [200] * 200
    assert all(r["usage"] is not None for r in results)
    rows = ledger(url)
    mine = {r["gen"]: r for r in results}
    assert len(mine) == 200 and set(mine) <= set(rows)
    client = (sum(r["usage"]["prompt_tokens"] for r in results), sum(r["usage"]["completion_tokens"] for r in results))
    booked = (sum(rows[g]["input_tokens"] for g in mine), sum(rows[g]["output_tokens"] for g in mine))
    assert booked == client
    client_cost = sum(chat_cost(r["usage"]) for r in results)
    assert sum(rows[g]["cost_nanousd"] for g in mine) == client_cost == before - credits_nanos(url, "acme")
    plain = [r for r in results if r["cost"] is not None]
    assert abs(sum(Decimal(repr(r["cost"])) for r in plain) - Decimal(sum(rows[r["gen"]]["cost_nanousd"] for r in plain)).scaleb(-9)) < Decimal("1e-12")
    assert all(rows[g]["status"] in ("completed", "incomplete") for g in mine)
    stopped = [r for (_, b), r in zip(bodies, results, strict=False) if b.get("stop") == "Kiln"]
    assert stopped and all(r["usage"]["completion_tokens"] < len("Kiln hosted gateway test reply. Kiln") for r in stopped)


def test_legacy_completions_are_admitted_and_metered(hosted):
    with httpx.Client(base_url=hosted.base_url, timeout=60) as c:
        for path in ("/v1/completions", "/completions"):
            r = c.post(path, json={"model": MODEL, "prompt": "hi"})
            assert r.status_code == 401, r.text
            assert_error(r.json())
            assert c.post(path, json={"model": MODEL, "prompt": "hi"}, headers=auth(hosted.keys["broke"])).status_code == 402
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 6}, headers=auth(hosted.keys["acme"]))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        row = ledger(hosted.db_url)[gen_id(r)]
        assert (row["input_tokens"], row["output_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 6)
        assert usd_to_nanos(usage["cost"]) == row["cost_nanousd"] == chat_cost(usage)
