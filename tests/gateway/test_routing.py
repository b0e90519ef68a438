"""Cache-aware routing across two workers of one model (scripted engine, named as such).

Which worker served a request is read from ``/metrics`` (``kiln_worker_requests_total``), as an
operator would see it. Each worker takes one request at a time with one more queued, so a
"busy" worker is one running a long stream, and an overloaded one has two. A key's worker is its
rendezvous-hash home (the same on every gateway replica: tests/e2e/test_gateway_replicas.py), so
the tests find keys that live on a given worker by sending them.
The same path with the real model is covered by tests/e2e/test_features_real_model.py
(``test_conversation_stays_on_the_worker_holding_its_prefix``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from ..conformance import assert_response
from ..support import Kiln

MODEL = "kiln-scripted"
_LINE = re.compile(r'^kiln_worker_requests_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    reply = "x" * 300  # 300 tokens at 10 ms each: a stream that keeps its worker busy for ~3 s
    args = ["--engine", "scripted", "--scripted-delay", "0.01", "--scripted-reply", reply, "--max-batch", "1", "--queue-depth", "1"]
    server = Kiln(tmp_path_factory.mktemp("routing"), worker_args=args, workers=2).start(timeout=60)
    yield server
    server.stop()


@pytest.fixture
def client(pair):
    with httpx.Client(base_url=pair.base_url, timeout=60) as c:
        yield c


def routed(client: httpx.Client) -> dict[str, float]:
    counts = {}
    for m in _LINE.finditer(client.get("/metrics").text):
        worker = re.search(r'worker="([^"]+)"', m["labels"])[1]
        counts[worker] = float(m["value"])
    return counts


def served_by(client: httpx.Client, body: dict, headers: dict | None = None) -> str:
    """Send one short request and return the worker it was routed to."""
    before = routed(client)
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 16, **body}, headers=headers)
    assert r.status_code == 200, r.text
    after = routed(client)
    grew = [w for w in after if after[w] > before.get(w, 0)]
    assert len(grew) == 1, (before, after)
    return grew[0]


@contextmanager
def busy(base_url: str, key: str, streams: int = 1, body: dict | None = None, model: str = MODEL) -> Iterator[None]:
    """Keep the worker that ``key`` sticks to busy with long streams until the block ends."""
    started = threading.Barrier(streams + 1)
    endings: list[str] = []

    def run() -> None:
        with httpx.Client(base_url=base_url, timeout=600) as c:
            with c.stream("POST", "/v1/responses", json={"model": model, "input": "Write a long essay.", "prompt_cache_key": key, "stream": True, **(body or {})}) as r:
                lines = r.iter_lines()
                for line in lines:
                    if "response.in_progress" in line:  # routed and sent to its worker
                        break
                started.wait()
                last = ""
                for line in lines:
                    if line.startswith("event: "):
                        last = line.removeprefix("event: ")
                endings.append(last)

    threads = [threading.Thread(target=run) for _ in range(streams)]
    for t in threads:
        t.start()
    started.wait(timeout=300)
    try:
        yield
    finally:
        for t in threads:
            t.join(timeout=600)
    # A stream the worker refused (queue full) would not have kept it busy.
    assert endings == ["response.completed"] * streams, endings


def key_living_elsewhere(client: httpx.Client, worker: str, prefix: str) -> tuple[str, str]:
    """A key whose worker is not ``worker``, and that worker (found by sending, while idle)."""
    for n in range(64):
        key = f"{prefix}-{n}"
        home = served_by(client, {"prompt_cache_key": key})
        if home != worker:
            return key, home
    pytest.fail("every key landed on one worker")


def test_key_goes_back_to_its_worker_even_when_it_is_the_busier_one(pair, client):
    home = served_by(client, {"prompt_cache_key": "conv-a"})
    other_key, other = key_living_elsewhere(client, home, "conv-b")
    assert served_by(client, {"prompt_cache_key": "conv-a"}) == home  # the same key, the same worker
    with busy(pair.base_url, "conv-a"):
        # A request without a key goes to the least-loaded worker: the other one.
        assert served_by(client, {}) == other
        # The known key returns to its worker although that one is running a stream.
        assert served_by(client, {"prompt_cache_key": "conv-a"}) == home
        assert served_by(client, {"prompt_cache_key": other_key}) == other
    assert served_by(client, {"prompt_cache_key": other_key}) == other


def test_overloaded_worker_gives_way_and_the_key_comes_back(pair, client):
    home = served_by(client, {"prompt_cache_key": "conv-c"})
    with busy(pair.base_url, "conv-c", streams=2):  # one running, one queued: full
        moved = served_by(client, {"prompt_cache_key": "conv-c"})
        assert moved != home
    # Once its worker has room again the key goes home: every gateway replica agrees on where a
    # key lives without remembering where it was last served.
    assert served_by(client, {"prompt_cache_key": "conv-c"}) == home


def test_session_header_routes_like_prompt_cache_key(pair, client):
    first = served_by(client, {}, headers={"session-id": "codex-session-1"})
    sticky_key = "pin-" + first
    # Pin a stream to ``first``'s worker through a key first served there, then check the session
    # still goes back to it rather than to the idle worker.
    for _ in range(10):
        if served_by(client, {"prompt_cache_key": sticky_key}) == first:
            break
        sticky_key += "+"
    else:
        pytest.fail("no key landed on the session's worker")
    explicit_key, elsewhere = key_living_elsewhere(client, first, "explicit-key-wins")
    with busy(pair.base_url, sticky_key):
        assert served_by(client, {}, headers={"session-id": "codex-session-1"}) == first
        assert served_by(client, {"prompt_cache_key": explicit_key}, headers={"session-id": "codex-session-1"}) == elsewhere


def test_server_default_temperature_applies_only_when_the_request_sets_none(tmp_path):
    """Not routing, but the same two-process setup: ``--default-temperature`` and
    ``--default-frequency-penalty`` are what run (and are echoed) for requests without their own;
    a request's own value wins (0 included)."""
    server = Kiln(tmp_path, gateway_args=["--default-temperature", "0.2", "--default-frequency-penalty", "0.5"], worker_args=["--engine", "scripted"]).start(timeout=60)
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            plain = c.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 16}).json()
            own = c.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 16, "temperature": 1.3, "frequency_penalty": 0}).json()
        assert_response(plain)
        assert_response(own)
        assert plain["temperature"] == 0.2 and own["temperature"] == 1.3
        assert plain["frequency_penalty"] == 0.5 and own["frequency_penalty"] == 0
    finally:
        server.stop()
