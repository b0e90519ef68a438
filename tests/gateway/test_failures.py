"""A worker that dies or fails mid-request: clients get a clean failure, the gateway stays up.

Uses the scripted engine (named as such) to inject the faults deterministically; the real-model
test in tests/e2e kills a real worker the same way.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.conformance import assert_error, assert_response, assert_stream
from tests.support import Kiln, stream


@pytest.fixture
def fragile(tmp_path):
    server = Kiln(tmp_path, worker_args=["--engine", "scripted", "--scripted-delay", "0.01"], workers=2).start(timeout=60)
    yield server
    server.stop()


def test_worker_crash_gives_502_and_gateway_keeps_serving(fragile):
    with httpx.Client(base_url=fragile.base_url, timeout=30) as client:
        r = client.post("/v1/responses", json={"model": "kiln-scripted", "input": "[[crash]]"})
        assert r.status_code == 502
        assert_error(r.json())
        ok = client.post("/v1/responses", json={"model": "kiln-scripted", "input": "hi", "max_output_tokens": 4})
        assert ok.status_code == 200
        assert_response(ok.json())


def test_worker_crash_mid_stream_gives_response_failed(fragile):
    with httpx.Client(base_url=fragile.base_url, timeout=30) as client:
        names, events = stream(client, {"model": "kiln-scripted", "input": "[[crash]]"})
        assert_stream(events, names)
        assert events[-1]["type"] == "response.failed"
        assert events[-1]["response"]["error"]["code"] == "server_error"
        assert client.get("/health").status_code == 200


def test_engine_error_fails_the_request_only(fragile):
    with httpx.Client(base_url=fragile.base_url, timeout=30) as client:
        r = client.post("/v1/responses", json={"model": "kiln-scripted", "input": "[[error]]"})
        assert r.status_code == 500
        assert_error(r.json())
        assert client.post("/v1/responses", json={"model": "kiln-scripted", "input": "hi", "max_output_tokens": 2}).status_code == 200


def test_full_queue_is_503(tmp_path):
    server = Kiln(tmp_path, worker_args=["--engine", "scripted", "--scripted-delay", "0.05", "--max-batch", "1", "--queue-depth", "1"]).start(timeout=60)
    try:
        import concurrent.futures as cf

        def post(_):
            return httpx.post(server.base_url + "/v1/responses", json={"model": "kiln-scripted", "input": "hi"}, timeout=60)

        with cf.ThreadPoolExecutor(6) as pool:
            codes = sorted(r.status_code for r in pool.map(post, range(6)))
        assert 200 in codes and 503 in codes, codes
    finally:
        server.stop()


def test_no_worker_health_is_503(tmp_path):
    server = Kiln(tmp_path, workers=0).start(timeout=60)
    try:
        assert httpx.get(server.base_url + "/health").status_code == 503
        r = httpx.post(server.base_url + "/v1/responses", json={"model": "x", "input": "hi"})
        assert r.status_code == 404
        assert_error(r.json())
    finally:
        server.stop()


@pytest.mark.parametrize("extra", [{}, {"context_management": [{"type": "compaction", "compact_threshold": 1}]}], ids=["generation", "compaction"])
def test_client_that_hangs_up_on_a_plain_request_frees_the_worker(tmp_path, extra):
    """A non-streaming client that disconnects while its answer (or the compaction before it)
    is being generated must not leave that work running on the worker."""
    server = Kiln(tmp_path, worker_args=["--engine", "scripted", "--scripted-delay", "0.02", "--scripted-reply", "x" * 400]).start(timeout=60)
    try:
        history = [{"role": "user", "content": "a " * 50}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c " * 50}]
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.base_url + "/v1/responses", json={"model": "kiln-scripted", "input": history, **extra}, timeout=0.5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            metrics = httpx.get(server.base_url + "/metrics").text
            if "kiln_requests_in_flight 0.0" in metrics and re.search(r"^kiln_worker_active\{.*\} 0\.0$", metrics, re.M):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the abandoned request kept running:\n" + metrics)
    finally:
        server.stop()
