"""A model whose worker is restarting is "busy, retry" (503), not "no such model" (404)."""

from __future__ import annotations

import time

import httpx
import pytest

from kiln.gateway.http.errors import ApiError
from kiln.gateway.pool.workers import KNOWN_MODELS_LIMIT, WorkerPool
from kiln.protocol import PROTOCOL_VERSION, Register
from tests.conformance import assert_error
from tests.support import Kiln


def _register(model: str, aliases: list[str] | None = None) -> Register:
    return Register(version=PROTOCOL_VERSION, worker_id="w", model=model, aliases=aliases or [], context_window=2048, capacity=1, queue_depth=1, pid=1)


def test_require_distinguishes_known_from_unknown_models():
    pool = WorkerPool("tcp://127.0.0.1:0")
    pool._remember(_register("m", ["m-alias"]))
    for name in ("m", "m-alias"):
        with pytest.raises(ApiError) as known:
            pool.require(name)
        assert known.value.status == 503 and known.value.code == "server_is_overloaded"
        assert int(known.value.headers["Retry-After"]) >= 1
    with pytest.raises(ApiError) as unknown:
        pool.require("other")
    assert unknown.value.status == 404 and unknown.value.code == "model_not_found" and unknown.value.param == "model"


def test_known_models_are_bounded():
    pool = WorkerPool("tcp://127.0.0.1:0")
    for i in range(KNOWN_MODELS_LIMIT + 10):
        pool._remember(_register(f"m{i}"))
    assert len(pool._known) == KNOWN_MODELS_LIMIT
    assert not pool.known("m0") and pool.known(f"m{KNOWN_MODELS_LIMIT + 9}")


def test_model_without_live_worker_is_503_with_retry_after(tmp_path):
    server = Kiln(tmp_path, worker_args=["--engine", "scripted"]).start(timeout=60)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            assert client.get("/v1/models/kiln-scripted").status_code == 200
            server.worker_procs[0].kill()
            deadline = time.monotonic() + 30  # the gateway drops it after the heartbeat timeout (3 s)
            while client.get("/health").status_code != 503 and time.monotonic() < deadline:
                time.sleep(0.2)
            r = client.get("/v1/models/kiln-scripted")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "server_is_overloaded"
            assert int(r.headers["retry-after"]) >= 1
            assert_error(r.json())
            missing = client.get("/v1/models/never-served")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    finally:
        server.stop()
