"""The summary's budget is bounded by what is summarized (issue 15, point 4), shown with a
scripted engine (named as such) whose "summary" is a 4,000-byte text that always fills its budget:
with the old fixed 1,024-token budget every compaction of a ~1,300-token history was refused as
not shortening; now each form returns a compaction whose replay is shorter."""

from __future__ import annotations

import httpx
import pytest

from tests.support import Kiln

MODEL = "kiln-scripted"


def history() -> list[dict]:
    """Six turns, about 1,300 byte-tokens."""
    items: list[dict] = []
    for t in range(6):
        items.append({"role": "user", "content": f"question {t} " + "q" * 95})
        items.append({"role": "assistant", "content": f"answer {t} " + "a" * 95})
    return items


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    s = Kiln(tmp_path_factory.mktemp("budget"), worker_args=["--engine", "scripted", "--scripted-reply", "summary " * 500]).start(timeout=60)
    try:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            yield c
    finally:
        s.stop()


def count(client, items) -> int:
    return client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": items}).json()["input_tokens"]


def test_compact_shortens_when_the_summarizer_rambles(client):
    before = count(client, history())
    assert 1200 <= before <= 1400, before
    r = client.post("/v1/responses/compact", json={"model": MODEL, "input": history()})
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    assert [i["type"] for i in output].count("compaction") == 1
    assert count(client, output) < before
    # Within the request's max_output_tokens as well.
    r = client.post("/v1/responses/compact", json={"model": MODEL, "input": history(), "max_output_tokens": 16})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] <= 16


def test_trigger_and_context_management_shorten(client):
    before = count(client, history())
    r = client.post("/v1/responses", json={"model": MODEL, "input": history() + [{"type": "compaction_trigger"}]})
    assert r.status_code == 200, r.text
    assert count(client, r.json()["output"]) < before
    body = {"model": MODEL, "input": history() + [{"role": "user", "content": "next"}], "max_output_tokens": 4, "context_management": [{"type": "compaction", "compact_threshold": 500}]}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["type"] == "compaction"
    assert r.json()["usage"]["input_tokens"] < before


def test_history_that_cannot_shorten_is_still_refused(client):
    """Automatic compaction over its threshold with nothing to summarize cannot make room: 400.
    (``/responses/compact`` accepts such a history and retains it all; tests/gateway/
    test_compaction_scripted.py.)"""
    body = {"model": MODEL, "input": [{"role": "user", "content": "only one"}], "context_management": [{"type": "compaction", "compact_threshold": 1}], "max_output_tokens": 4}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
