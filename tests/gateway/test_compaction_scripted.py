"""Compaction rules through real processes with the scripted engine (named as such): its
"summary" is a fixed sentence, which is all these gateway/worker rules need. tests/e2e runs the
bundled model through the same paths."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from tests.conformance import assert_api_object, assert_error, assert_stream
from tests.support import Kiln, stream

MODEL = "kiln-scripted"


def history(turns: int, size: int = 300) -> list[dict]:
    items: list[dict] = [{"role": "developer", "content": "Be helpful."}]
    for t in range(turns):
        items.append({"role": "user", "content": f"question {t} " + "x" * size})
        items.append({"role": "assistant", "content": f"answer {t} " + "y" * size})
    items.append({"role": "user", "content": "latest question"})
    return items


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Kiln(tmp_path_factory.mktemp("compact"), worker_args=["--engine", "scripted"]).start(timeout=60)
    yield s
    s.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def test_compact_endpoint_shape(client):
    r = client.post("/v1/responses/compact", json={"model": MODEL, "input": history(6), "keep_tokens": 400})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response.compaction" and body["model"] == MODEL
    kinds = [i["type"] for i in body["output"]]
    # The spec's order (and OpenAI's): kept system/developer messages, retained items, the item.
    assert kinds.count("compaction") == 1 and kinds[-1] == "compaction"
    assert body["output"][0]["role"] == "developer"
    retained = body["output"][1:-1]
    assert retained[-1]["content"] == [{"type": "input_text", "text": "latest question"}]
    assert body["usage"]["output_tokens"] > 0
    assert_api_object("CompactResource", body)
    assert client.post("/responses/compact", json={"model": MODEL, "input": history(6)}).status_code == 200


def test_compact_output_validates_with_every_item_kind(client):
    """Retained user messages keep their input types; assistant text, calls and outputs are in
    their output form (status, annotations): the object validates against CompactResource."""
    items = history(3)[:-1] + [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "user", "content": "latest question"},
    ]
    body = client.post("/v1/responses/compact", json={"model": MODEL, "input": items, "keep_tokens": 4000}).json()
    assert_api_object("CompactResource", body)
    out = body["output"]
    assert [i["type"] for i in out][-6:] == ["message", "function_call", "function_call_output", "message", "message", "compaction"]
    assert out[-3]["content"][0]["type"] == "output_text" and all(i.get("status") == "completed" for i in out[:-1])
    users = [i for i in out if i.get("role") == "user"]
    assert {p["type"] for u in users for p in u["content"]} == {"input_text"}


@pytest.mark.parametrize("items", [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "user", "content": "hi"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "assistant", "content": "Hello!"}],
])
def test_any_history_compacts_even_with_nothing_to_summarize(client, items):
    """A client may compact any history; with nothing before the latest user message everything
    is retained, the summary is empty and nothing was generated."""
    r = client.post("/v1/responses/compact", json={"model": MODEL, "input": items})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_api_object("CompactResource", body)
    assert [i["type"] for i in body["output"]] == ["message"] * len(items) + ["compaction"]
    assert body["usage"]["output_tokens"] == 0
    before = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": items}).json()["input_tokens"]
    replay = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": body["output"]}).json()["input_tokens"]
    assert replay == before  # an empty summary renders as nothing; the replayed items once


def test_compact_resolves_item_references(client):
    first = client.post("/v1/responses", json={"model": MODEL, "input": "question 0 " + "x" * 300, "max_output_tokens": 8}).json()
    items = [{"type": "item_reference", "id": first["output"][0]["id"]}] + history(4)[1:]
    r = client.post("/v1/responses/compact", json={"model": MODEL, "input": items, "keep_tokens": 400})
    assert r.status_code == 200, r.text
    missing = client.post("/v1/responses/compact", json={"model": MODEL, "input": [{"type": "item_reference", "id": "msg_nope"}, *history(2)]})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input[0].id"


def test_compacted_output_replays(client):
    body = client.post("/v1/responses/compact", json={"model": MODEL, "input": history(6), "keep_tokens": 400}).json()
    before = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": history(6)}).json()["input_tokens"]
    replay = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": body["output"]}).json()["input_tokens"]
    only_item = [i for i in body["output"] if i["type"] != "message" or i["role"] == "developer"]
    alone = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": only_item}).json()["input_tokens"]
    assert replay < before
    assert alone == replay  # the item carries the retained turns; replayed duplicates are skipped
    r = client.post("/v1/responses", json={"model": MODEL, "input": body["output"] + [{"role": "user", "content": "next"}], "max_output_tokens": 4})
    assert r.status_code == 200


def test_split_never_separates_call_from_output(client):
    items = history(2)[:-1] + [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "z" * 200},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "latest question"},
    ]
    body = client.post("/v1/responses/compact", json={"model": MODEL, "input": items, "keep_tokens": 150}).json()
    kept_types = [i["type"] for i in body["output"]]
    assert not ("function_call_output" in kept_types and "function_call" not in kept_types)


@pytest.mark.parametrize(
    "extra, param",
    [({"stream": True}, "stream"), ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"conversation": "c"}, "conversation"), ({"keep_tokens": 0}, "keep_tokens"),
        ({"max_output_tokens": 20000}, "max_output_tokens")],
)
def test_compact_refusals(client, extra, param):
    r = client.post("/v1/responses/compact", json={"model": MODEL, "input": history(3), **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert_error(r.json())


def test_history_longer_than_window_is_refused(client):
    r = client.post("/v1/responses/compact", json={"model": MODEL, "input": history(3, size=5000)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_compaction_item_is_client_data(client):
    """The spec: a compaction item's content "is not encrypted and is treated as client data, like
    any input array". One the client wrote itself (or edited) is replayed; one that is not what a
    compaction holds is refused with 400 naming it, in OpenAI's error shape."""
    body = client.post("/v1/responses/compact", json={"model": MODEL, "input": history(6)}).json()
    item = next(i for i in body["output"] if i["type"] == "compaction")
    payload = json.loads(base64.urlsafe_b64decode(item["encrypted_content"] + "=" * (-len(item["encrypted_content"]) % 4)))
    assert set(payload) == {"summary", "retained"}  # readable base64url JSON, as the spec says
    own = {"summary": "The user likes red boxes.", "retained": [{"role": "user", "content": "Which box?"}]}
    written = base64.urlsafe_b64encode(json.dumps(own).encode()).decode().rstrip("=")
    for content in (item["encrypted_content"], written):
        r = client.post("/v1/responses", json={"model": MODEL, "input": [{"type": "compaction", "encrypted_content": content}, {"role": "user", "content": "x"}], "max_output_tokens": 3})
        assert r.status_code == 200, r.text
    bad = [
        "not base64 json!",
        base64.urlsafe_b64encode(b'["a list"]').decode(),
        base64.urlsafe_b64encode(json.dumps({"summary": 3}).encode()).decode(),
        base64.urlsafe_b64encode(json.dumps({"summary": "s", "retained": [{"role": "robot", "content": "x"}]}).encode()).decode(),
        base64.urlsafe_b64encode(json.dumps({"summary": "s", "retained": [{"type": "compaction", "encrypted_content": "x"}]}).encode()).decode(),
    ]
    for content in bad:
        r = client.post("/v1/responses", json={"model": MODEL, "input": [{"type": "compaction", "encrypted_content": content}, {"role": "user", "content": "x"}]})
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["param"] == "input[0].encrypted_content"
        assert_error(r.json())


def test_auto_compaction_stream_events(client):
    names, events = stream(client, {"model": MODEL, "input": history(6), "max_output_tokens": 8, "context_management": [{"type": "compaction", "compact_threshold": 500}]})
    assert_stream(events, names)
    kinds = [e["type"] for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "mlx.compaction.started", "mlx.compaction.completed", "response.output_item.added"]
    started, completed = events[2], events[3]
    assert started["response_id"] == events[0]["response"]["id"]
    assert completed["input_tokens_after"] < completed["input_tokens_before"] == started["input_tokens"]
    final = events[-1]["response"]
    assert final["output"][0]["type"] == "compaction" and final["output"][1]["type"] == "message"


def test_below_threshold_does_not_compact_and_chain_replays(client):
    first = client.post("/v1/responses", json={"model": MODEL, "input": history(6), "max_output_tokens": 4, "context_management": [{"type": "compaction", "compact_threshold": 500}]}).json()
    assert first["output"][0]["type"] == "compaction"
    second = client.post("/v1/responses",
        json={"model": MODEL, "input": "and then?", "previous_response_id": first["id"], "max_output_tokens": 4, "context_management": [{"type": "compaction", "compact_threshold": 100000}]}).json()
    assert second["output"][0]["type"] == "message"
    chained = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "and then?", "previous_response_id": first["id"]}).json()["input_tokens"]
    full = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": history(6)}).json()["input_tokens"]
    assert chained < full


def test_compaction_trigger_answers_one_item(client):
    names, events = stream(client, {"model": MODEL, "input": history(4) + [{"type": "compaction_trigger"}], "store": False})
    assert_stream(events, names)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["compaction"]
    assert events[-1]["type"] == "response.completed"


def test_bad_threshold_is_400(client):
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "context_management": [{"type": "compaction", "compact_threshold": 0}]})
    assert r.status_code == 400


def test_background_compaction_failure_fails_job(client):
    import time

    r = client.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": "only"}], "background": True, "context_management": [{"type": "compaction", "compact_threshold": 1}]})
    assert r.status_code == 200
    rid = r.json()["id"]
    for _ in range(200):
        obj = client.get(f"/v1/responses/{rid}").json()
        if obj["status"] not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert obj["status"] == "failed" and obj["error"]["code"] == "invalid_prompt"
