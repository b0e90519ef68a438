"""Stored responses, conversations, background jobs and input_tokens (spec: Endpoints,
Background Mode, Storage Flags).

These rules are the gateway's, so most run with the scripted engine (named as such) where
small limits and slow tokens make eviction, 429 and 503 deterministic; tests/e2e repeats the
main paths with the real model.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conformance import assert_error, assert_response, assert_stream
from tests.support import Kiln, stream

MODEL = "kiln-scripted"


def _start(tmp_path, *gateway_args, delay="0.002", extra_worker=()):
    return Kiln(tmp_path, gateway_args=list(gateway_args), worker_args=["--engine", "scripted", "--scripted-delay", delay, *extra_worker]).start(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = _start(tmp_path_factory.mktemp("store"), delay="0.01")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture
def sdk(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def create(client, **body):
    r = client.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return r.json()


def poll(client, rid, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = client.get(f"/v1/responses/{rid}").json()
        if obj["status"] not in ("queued", "in_progress"):
            return obj
        time.sleep(0.05)
    raise AssertionError("job did not finish")


def test_retrieve_delete_and_input_items(sdk):
    resp = sdk.responses.create(model=MODEL, input="hello", max_output_tokens=4)
    got = sdk.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    assert_response(got.model_dump(mode="json", exclude_unset=True))
    items = sdk.responses.input_items.list(resp.id)
    assert [i.content[0].text if hasattr(i.content[0], "text") else None for i in items.data] == ["hello"]
    sdk.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(resp.id)


def test_aliases_without_v1(client):
    rid = create(client, input="hi")["id"]
    assert client.get(f"/responses/{rid}").status_code == 200
    assert client.get(f"/responses/{rid}/input_items").status_code == 200
    assert client.delete(f"/responses/{rid}").json()["deleted"] is True


def test_store_false_is_not_persisted(client):
    rid = create(client, input="hi", store=False)["id"]
    r = client.get(f"/v1/responses/{rid}")
    assert r.status_code == 404
    assert_error(r.json())


def test_previous_response_id_chains_history(sdk, server):
    first = sdk.responses.create(model=MODEL, input="my name is Ada", instructions="first instructions", max_output_tokens=4)
    second = sdk.responses.create(model=MODEL, input="what is my name?", previous_response_id=first.id, max_output_tokens=4)
    items = sdk.responses.input_items.list(second.id, order="asc").data
    texts = [i.content[0].text for i in items if i.type == "message"]
    assert texts == ["my name is Ada", first.output_text, "what is my name?"]
    assert second.previous_response_id == first.id
    assert second.instructions is None  # instructions are not carried


def test_unknown_previous_response_is_400(client):
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert_error(r.json())


def test_previous_and_conversation_are_exclusive(client):
    rid = create(client, input="x")["id"]
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": rid, "conversation": "c1"})
    assert r.status_code == 400


def test_replayed_output_as_input(client):
    first = create(client, input="hi")
    r = client.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": "hi"}, *first["output"], {"role": "user", "content": "again"}], "max_output_tokens": 4})
    assert r.status_code == 200, r.text


def test_conversation_appends_turns(client):
    conv = client.post("/v1/conversations", json={}).json()["id"]  # an unknown id is a 404
    a = create(client, input="turn one", conversation=conv)
    b = create(client, input="turn two", conversation={"id": conv})
    items = client.get(f"/v1/responses/{b['id']}/input_items", params={"order": "asc"}).json()["data"]
    texts = [i["content"][0]["text"] if isinstance(i["content"], list) else i["content"] for i in items]
    assert texts == ["turn one", a["output"][0]["content"][0]["text"], "turn two"]
    assert b["conversation"] == {"id": conv}


def test_input_tokens_counts_history(sdk, client):
    first = sdk.responses.create(model=MODEL, input="abc", max_output_tokens=4)
    alone = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "more"}).json()
    chained = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "more", "previous_response_id": first.id}).json()
    assert alone["object"] == "response.input_tokens"
    assert chained["input_tokens"] > alone["input_tokens"] > 0
    counted = sdk.responses.input_tokens.count(model=MODEL, input="more")
    assert counted.input_tokens == alone["input_tokens"]
    assert client.post("/responses/input_tokens", json={"model": MODEL, "input": "more"}).json() == alone


def test_background_lifecycle(client):
    job = create(client, input="hi", background=True, max_output_tokens=20)
    assert job["status"] == "queued" and job["background"] is True and job["output"] == []
    assert job["usage"]["total_tokens"] == 0
    assert_response(job)
    seen = set()
    deadline = time.monotonic() + 30
    while True:
        obj = client.get(f"/v1/responses/{job['id']}").json()
        assert obj["background"] is True
        seen.add(obj["status"])
        if obj["status"] in ("queued", "in_progress"):
            assert obj["output"] == [] and obj["usage"]["output_tokens"] == 0
        else:
            break
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert obj["status"] == "incomplete" and obj["output"]
    assert_response(obj)
    foreground = create(client, input="hi")
    assert "background" not in foreground


def test_background_cancel_and_delete_rules(client):
    job = create(client, input="hi", background=True, max_output_tokens=2000)
    r = client.delete(f"/v1/responses/{job['id']}")
    assert r.status_code == 400
    chained = client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": job["id"]})
    assert chained.status_code == 400
    assert "has not finished (status:" in chained.json()["error"]["message"]
    cancelled = client.post(f"/v1/responses/{job['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    assert poll(client, job["id"])["status"] == "cancelled"
    assert client.delete(f"/v1/responses/{job['id']}").status_code == 200


def test_background_survives_dropped_connection(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        job = create(c, input="hi", background=True, max_output_tokens=30)
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        assert poll(c, job["id"])["status"] == "incomplete"


def test_background_store_false_polls_but_does_not_chain(client):
    job = create(client, input="hi", background=True, store=False, max_output_tokens=5)
    assert poll(client, job["id"])["status"] == "incomplete"
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": job["id"]})
    assert r.status_code == 400


def test_background_with_stream_is_400(client):
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True, "stream": True})
    assert r.status_code == 400


def test_cancel_stops_a_foreground_stream(server, client):
    with httpx.Client(base_url=server.base_url, timeout=60) as c2:
        with client.stream("POST", "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 3000}) as r:
            import json

            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "response.output_text.delta" and len(events) == 6:
                        assert c2.post(f"/v1/responses/{events[0]['response']['id']}/cancel").status_code == 200
    assert events[-1]["response"]["status"] == "cancelled"
    assert_stream(events)


def test_background_worker_failure_fails_job(tmp_path):
    s = _start(tmp_path)
    try:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            job = create(c, input="[[error]]", background=True)
            final = poll(c, job["id"])
            assert final["status"] == "failed" and final["error"]["code"] == "server_error"
            crash = create(c, input="[[crash]]", background=True)
            final = poll(c, crash["id"])
            assert final["status"] == "failed" and final["error"]["code"] == "server_error"
            assert_response(final)
    finally:
        s.stop()


def test_eviction_by_entries_bytes_and_ttl(tmp_path):
    s = _start(tmp_path, "--responses-store-max-entries", "2", "--responses-store-ttl-secs", "2")
    try:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            ids = [create(c, input=f"m{i}")["id"] for i in range(3)]
            assert c.get(f"/v1/responses/{ids[0]}").status_code == 404
            assert c.get(f"/v1/responses/{ids[2]}").status_code == 200
            time.sleep(2.2)
            assert c.get(f"/v1/responses/{ids[2]}").status_code == 404
    finally:
        s.stop()
    s = _start(tmp_path, "--responses-store-max-bytes", "3000")
    try:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            ids = [create(c, input="x" * 600)["id"] for i in range(3)]
            assert c.get(f"/v1/responses/{ids[0]}").status_code == 404
            assert c.get(f"/v1/responses/{ids[-1]}").status_code == 200
    finally:
        s.stop()


def test_store_off_answers_400(tmp_path):
    s = _start(tmp_path, "--responses-store-max-entries", "0")
    try:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            rid = create(c, input="hi")["id"]
            for r in (c.get(f"/v1/responses/{rid}"), c.delete(f"/v1/responses/{rid}"), c.post(f"/v1/responses/{rid}/cancel")):
                assert r.status_code == 400
                assert_error(r.json())
            r = c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": rid})
            assert r.status_code == 400
            r = c.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True})
            assert r.status_code == 400
    finally:
        s.stop()


def test_store_none_mode_is_the_hosted_contract(tmp_path):
    s = _start(tmp_path, "--store", "none")
    try:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            r = c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_1"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
            assert create(c, input="x", previous_response_id=None)["status"]
            for r in (c.get("/v1/responses/resp_1"), c.delete("/v1/responses/resp_1"), c.get("/v1/responses/resp_1/input_items")):
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
                assert_error(r.json())
    finally:
        s.stop()


def test_background_limits_429_and_503(tmp_path):
    s = _start(tmp_path, "--responses-background-max-jobs", "2", delay="0.05", extra_worker=("--max-batch", "1", "--queue-depth", "1"))
    try:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            a = create(c, input="hi", background=True, max_output_tokens=500)
            b = create(c, input="hi", background=True, max_output_tokens=500)
            r = c.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True})
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            time.sleep(1.5)  # both jobs are now at the worker: one decoding, one queued -> full
            r = c.post("/v1/responses", json={"model": MODEL, "input": "x", "stream": False, "max_output_tokens": 2})
            assert r.status_code == 503
            assert_error(r.json())
            for job in (a, b):
                c.post(f"/v1/responses/{job['id']}/cancel")
    finally:
        s.stop()


def test_background_disabled_configurations(tmp_path):
    s = _start(tmp_path, "--responses-background-max-jobs", "0")
    try:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            r = c.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True})
            assert r.status_code == 400
    finally:
        s.stop()


def test_stream_includes_stored_object(client):
    names, events = stream(client, {"model": MODEL, "input": "hi", "max_output_tokens": 5})
    assert_stream(events, names)
    rid = events[-1]["response"]["id"]
    assert client.get(f"/v1/responses/{rid}").json()["output"] == events[-1]["response"]["output"]


def test_200_concurrent_background_jobs_none_lost(tmp_path):
    """Every job ends terminal or got a 429; the store stays within its byte budget."""
    import concurrent.futures as cf

    budget = 400_000
    s = _start(tmp_path, "--responses-background-max-jobs", "16", "--responses-store-max-bytes", str(budget), delay="0.001")
    try:
        def submit(i):
            r = httpx.post(s.base_url + "/v1/responses", json={"model": MODEL, "input": f"job {i}", "background": True, "max_output_tokens": 16}, timeout=60)
            return r.status_code, r.json()

        with cf.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(submit, range(200)))
        admitted = [body["id"] for code, body in results if code == 200]
        refused = [body for code, body in results if code == 429]
        assert len(admitted) + len(refused) == 200
        assert all(b["error"]["code"] == "rate_limit_exceeded" for b in refused)
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            finals = [poll(c, rid)["status"] for rid in admitted]
            health = c.get("/health").json()["stores"]
        assert all(st in ("completed", "incomplete") for st in finals)
        assert health["responses"]["bytes"] <= budget and health["background"]["active"] == 0
        print(f"\n200 background jobs: {len(admitted)} admitted and finished, {len(refused)} got 429; store {health['responses']['entries']} entries, {health['responses']['bytes']} bytes of {budget}")
    finally:
        s.stop()
