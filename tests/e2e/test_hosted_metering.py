"""Hosted metering at its edges, against real processes (scripted worker, named as such):
reservations keep credits from overdrawing, what a client received is billed however its stream
ends, token counting is admitted like generation, and a hung request ends at its deadline.

Shares the helpers of test_hosted_gateway.py; a gateway of its own with short deadlines.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e.test_hosted_gateway import MODEL, auth, credits_nanos, gen_id, kiln_cli, ledger, new_org, run, start_hosted


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metering")
    url = f"sqlite:///{tmp}/kiln.db"
    keys = {"acme": new_org(url, "acme", concurrency=32)}
    server = start_hosted(tmp, url, extra=["--event-timeout", "1", "--first-event-timeout", "5"])
    server.db_url = url
    server.keys = keys
    yield server
    server.stop()


def test_credits_at_the_edge_of_zero_overdraw_by_at_most_one_reservation(hosted):
    """20 concurrent requests against credits for about three: the reservation is taken in the
    database while the balance is positive, so the balance never goes below minus one request's
    reservation, and what was debited is what the ledger says."""
    url = hosted.db_url
    # one request: ~1024+ input tokens reserved at $0.10/M and 16 output at $0.30/M ~ 1.1e-4 USD
    key = new_org(url, "edge", credits="0.0003", concurrency=32)
    before = credits_nanos(url, "edge")
    body = {"model": MODEL, "input": "x", "max_output_tokens": 16}

    async def go():
        async with httpx.AsyncClient(base_url=hosted.base_url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/responses", json=body, headers=auth(key)) for _ in range(20)))

    answers = run(go())
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 402}, statuses
    assert statuses.count(200) >= 1 and statuses.count(402) >= 1, statuses
    rows = {g: r for g, r in ledger(url).items() if r["org_id"] == ledger(url)[gen_id(answers[statuses.index(200)])]["org_id"]}
    assert all(r["status"] != "pending" for r in rows.values()), rows
    after = credits_nanos(url, "edge")
    debited = before - after
    assert debited == sum(r["cost_nanousd"] for r in rows.values())
    # one reservation: (len(json '"x"') + 1024) input tokens + 16 output tokens
    one_reservation = ((3 + 1024) * 100 + 16 * 300)  # nano-USD at $0.10 / $0.30 per million
    assert after >= -one_reservation, (before, after)
    # the balance is read live: once it is at or below zero the very next request is refused
    if after <= 0:
        r = httpx.post(hosted.base_url + "/v1/responses", json=body, headers=auth(key), timeout=30)
        assert r.status_code == 402 and r.json()["error"]["code"] == "insufficient_quota"
    kiln_cli(url, "orgs", "credit", "edge", "1")
    r = httpx.post(hosted.base_url + "/v1/responses", json=body, headers=auth(key), timeout=30)
    assert r.status_code == 200, r.text  # a top-up is visible at once, not after a cache expires


def test_a_stream_cut_after_its_text_is_billed_for_what_it_delivered(hosted):
    key = hosted.keys["acme"]
    with httpx.Client(base_url=hosted.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/responses", json={"model": MODEL, "input": "cut me", "stream": True}, headers=auth(key)) as s:
            g = gen_id(s)
            deltas = 0
            for line in s.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                    deltas += 1
                    if deltas == 30:
                        break
    row = _settled(hosted.db_url, g)
    assert row["status"] == "incomplete", row
    assert row["output_tokens"] >= 30 and row["input_tokens"] > 0, row
    assert row["cost_nanousd"] > 0, row


def test_token_counting_is_admitted_like_generation(hosted):
    url = hosted.db_url
    broke = new_org(url, "broke", credits="0")
    body = {"model": MODEL, "input": "count me"}
    r = httpx.post(hosted.base_url + "/v1/responses/input_tokens", json=body, headers=auth(broke), timeout=30)
    assert r.status_code == 402, r.text
    r = httpx.post(hosted.base_url + "/v1/responses/input_tokens", json=body, timeout=30)
    assert r.status_code == 401, r.text
    r = httpx.post(hosted.base_url + "/v1/responses/input_tokens", json={**body, "model": "unserved-model"}, headers=auth(hosted.keys["acme"]), timeout=30)
    assert r.status_code == 503, r.text
    r = httpx.post(hosted.base_url + "/v1/responses/input_tokens", json=body, headers=auth(hosted.keys["acme"]), timeout=30)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    assert gen_id(r) not in ledger(url)  # counting is not billed


def test_a_hung_request_ends_at_its_deadline_and_frees_its_slot(hosted):
    url = hosted.db_url
    key = new_org(url, "hang", concurrency=1)
    body = {"model": MODEL, "input": "[[hang]]"}
    r = httpx.post(hosted.base_url + "/v1/responses", json=body, headers=auth(key), timeout=60)
    assert r.status_code == 502 and r.headers["content-type"].startswith("text/plain"), r.text
    assert ledger(url)[gen_id(r)]["cost_nanousd"] == 0
    with httpx.Client(base_url=hosted.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/responses", json={**body, "stream": True}, headers=auth(key)) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "server_error"
    # concurrency 1: the slot came back both times
    r = httpx.post(hosted.base_url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4}, headers=auth(key), timeout=60)
    assert r.status_code == 200, r.text


def test_unauthenticated_bodies_are_never_read(hosted):
    """40 connections declaring 30 MiB bodies without a key get 401 at once: nothing is buffered."""
    import socket

    socks = []
    try:
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", hosted.port), timeout=10)
            s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 31457280\r\n\r\n" + b"x" * 65536)
            socks.append(s)
        for s in socks:
            head = s.recv(4096)
            assert head.startswith(b"HTTP/1.1 401"), head[:200]
    finally:
        for s in socks:
            s.close()


def _settled(url: str, generation_id: str, within: float = 5.0) -> dict:
    """The ledger row once it is no longer pending (a cut stream settles a moment after the cut)."""
    import time

    deadline = time.monotonic() + within
    while True:
        row = ledger(url).get(generation_id)
        if (row is not None and row["status"] != "pending") or time.monotonic() > deadline:
            return row
        time.sleep(0.05)
