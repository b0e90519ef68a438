"""The Anthropic Messages door in hosted mode, against real processes (scripted worker, named as
such): the key in ``x-api-key`` or Bearer, 401/402/429 in Anthropic's error shape, the
generation-id header, cost on non-streaming bodies, and one ledger row per request equal to the
usage the client saw, over 200 mixed requests.

Shares the helpers of test_hosted_gateway.py; a gateway of its own.
"""

from __future__ import annotations

import asyncio
import json
import random

import anthropic
import httpx
import pytest

from kiln.gateway.accounts.money import usd_to_nanos
from tests.e2e.test_hosted_gateway import (
    MODEL,
    credits_nanos,
    eventually_status,
    gen_id,
    ledger,
    new_org,
    run,
    start_hosted,
)


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("anthropic-hosted")
    url = f"sqlite:///{tmp}/kiln.db"
    keys = {"acme": new_org(url, "acme", concurrency=48)}
    server = start_hosted(tmp, url)
    keys["small"] = new_org(url, "small", concurrency=1)
    keys["broke"] = new_org(url, "broke", credits="0")
    server.db_url = url
    server.keys = keys
    yield server
    server.stop()


def key_header(key: str) -> dict[str, str]:
    return {"x-api-key": key, "anthropic-version": "2023-06-01"}


def short(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello!"}], **extra}


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == kind and body["error"]["message"], body


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_401_402_in_anthropics_shape(hosted, path):
    # One connection each: a refusal sent before the body is read closes its connection, which a
    # pooled client can race with its next request.
    def post(headers: dict[str, str]) -> httpx.Response:
        return httpx.post(hosted.base_url + path, json=short(), headers=headers, timeout=60)

    _anthropic_error(post({}), 401, "authentication_error")
    _anthropic_error(post(key_header("sk-kiln-not-a-key")), 401, "authentication_error")
    _anthropic_error(post({"Authorization": "Bearer sk-kiln-not-a-key"}), 401, "authentication_error")
    _anthropic_error(post(key_header(hosted.keys["broke"])), 402, "billing_error")


def test_sdk_with_x_api_key_is_metered_with_cost(hosted):
    client = anthropic.Anthropic(base_url=hosted.base_url, api_key=hosted.keys["acme"], max_retries=0, timeout=60)
    raw = client.messages.with_raw_response.create(**short())
    message = raw.parse()
    generation = raw.headers["x-kiln-generation-id"]
    row = ledger(hosted.db_url)[generation]
    assert row["status"] == "incomplete" and message.stop_reason == "max_tokens"  # 4 tokens of a long reply
    assert (row["input_tokens"], row["output_tokens"]) == (message.usage.input_tokens + message.usage.cache_read_input_tokens, message.usage.output_tokens)
    assert usd_to_nanos(str(message.usage.model_extra["cost"])) == row["cost_nanousd"] > 0
    counted = client.messages.count_tokens(model=MODEL, messages=short()["messages"])
    assert counted.input_tokens == row["input_tokens"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=hosted.base_url, api_key="sk-kiln-wrong", max_retries=0).messages.create(**short())


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_429_in_anthropics_shape_and_the_slot_comes_back(hosted, path):
    key = hosted.keys["small"]  # concurrency 1
    hold = {"model": MODEL, "max_tokens": 2000, "stream": True, "messages": [{"role": "user", "content": "hold"}]}
    def post() -> httpx.Response:  # a connection each, as above
        return httpx.post(hosted.base_url + path, json=short(), headers=key_header(key), timeout=60)

    with httpx.Client(base_url=hosted.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/messages", json=hold, headers=key_header(key)) as s:
            assert s.status_code == 200
            _anthropic_error(post(), 429, "rate_limit_error")
    assert eventually_status(post).status_code == 200  # the abandoned stream's slot came back


async def _call(c: httpx.AsyncClient, key: str, body: dict) -> dict:
    """What the client saw of one request: generation id and usage (streamed or not)."""
    if not body.get("stream"):
        r = await c.post("/v1/messages", json=body, headers=key_header(key))
        assert r.status_code == 200, r.text
        return {"gen": gen_id(r), "usage": r.json()["usage"], "stop_reason": r.json()["stop_reason"]}
    async with c.stream("POST", "/v1/messages", json=body, headers=key_header(key)) as r:
        assert r.status_code == 200
        usage: dict = {}
        stop_reason = None
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "message_start":
                    usage.update(event["message"]["usage"])
                elif event["type"] == "message_delta":
                    usage.update(event["usage"])
                    stop_reason = event["delta"]["stop_reason"]
        return {"gen": gen_id(r), "usage": usage, "stop_reason": stop_reason}


def test_ledger_rows_equal_client_seen_usage_over_200_mixed_requests(hosted):
    key, url = hosted.keys["acme"], hosted.db_url
    before = credits_nanos(url, "acme")
    rng = random.Random(17)
    bodies = []
    for i in range(200):
        body = {"model": MODEL, "max_tokens": rng.randint(1, 12), "stream": i % 2 == 0, "messages": [{"role": "user", "content": "x" * rng.randint(1, 120)}]}
        if i % 5 == 0:
            body["stop_sequences"] = ["hosted"]  # the scripted reply holds it: stopped by the door
        if i % 7 == 0:
            body["system"] = "Be brief."
        bodies.append(body)

    async def go():
        sem = asyncio.Semaphore(24)
        async with httpx.AsyncClient(base_url=hosted.base_url, timeout=60) as c:
            async def one(body):
                async with sem:
                    return await _call(c, key, body)
            return await asyncio.gather(*(one(b) for b in bodies))

    results = run(go())
    rows = ledger(url)
    assert len({r["gen"] for r in results}) == 200
    for result in results:
        row, usage = rows[result["gen"]], result["usage"]
        expected = {"max_tokens": "incomplete", "end_turn": "completed", "stop_sequence": "completed"}[result["stop_reason"]]
        assert row["status"] == expected, (row, result)
        assert row["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"], (row, usage)
        assert row["cached_tokens"] == usage["cache_read_input_tokens"], (row, usage)
        assert row["output_tokens"] == usage["output_tokens"], (row, usage)
        if "cost" in usage:
            assert usd_to_nanos(str(usage["cost"])) == row["cost_nanousd"]
    debited = before - credits_nanos(url, "acme")
    assert debited == sum(rows[r["gen"]]["cost_nanousd"] for r in results)
    stopped = [r for r, b in zip(results, bodies, strict=False) if "stop_sequences" in b]
    assert any(r["stop_reason"] == "stop_sequence" for r in stopped)
