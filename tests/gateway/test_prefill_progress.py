"""A long prompt being prefilled is not a hung worker: its progress resets the event deadline.

With the gateway's deadlines at 1 s, the scripted engine (named as such) spends 2.5 s on a
``[[slow-prefill]]`` prompt, reporting progress per chunk as the real scheduler does, and as long
on a ``[[silent-prefill]]`` one without a word: the first is answered, the second still fails 504.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conformance import assert_error, assert_response
from tests.support import Kiln, stream

MODEL = "kiln-scripted"


@pytest.fixture(scope="module")
def impatient(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefill")
    server = Kiln(tmp, gateway_args=["--first-event-timeout", "1", "--event-timeout", "1"], worker_args=["--engine", "scripted"]).start(timeout=60)
    yield server
    server.stop()


def test_prefill_that_reports_progress_outlives_the_event_deadline(impatient):
    with httpx.Client(base_url=impatient.base_url, timeout=30) as client:
        r = client.post("/v1/responses", json={"model": MODEL, "input": "[[slow-prefill]] a long prompt", "max_output_tokens": 4})
        assert r.status_code == 200, r.text
        assert_response(r.json())
        assert r.json()["status"] == "incomplete"  # cut at max_output_tokens: it generated
        names, _ = stream(client, {"model": MODEL, "input": "[[slow-prefill]] streamed", "max_output_tokens": 4})
        assert "response.failed" not in names and names[-1] == "response.incomplete"


def test_silent_prefill_still_times_out(impatient):
    with httpx.Client(base_url=impatient.base_url, timeout=30) as client:
        r = client.post("/v1/responses", json={"model": MODEL, "input": "[[silent-prefill]] a long prompt", "max_output_tokens": 4})
        assert r.status_code == 504, r.text
        assert_error(r.json())
        ok = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4})
        assert ok.status_code == 200  # the worker keeps serving
