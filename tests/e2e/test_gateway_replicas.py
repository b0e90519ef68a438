"""Two gateway replicas and the workers they share, as real processes on loopback.

Every worker connects to both gateways (one ``--gateway`` each); the gateways are reached on their
own ports (tests/cluster.py without HAProxy: these tests choose the replica themselves). The scripted engine (named as
such) plays the model where the test is about capacity and faults: its ``[[hang]]`` prompt holds a
request (and its slot) until the worker cancels it, which is how a test sees that the worker gave
up on a dead gateway's requests. One test serves the real bundled model through both replicas, and one runs the worker in its own
network namespace (another host, simulated), reaching both gateways over a veth pair.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from openai import OpenAI

from tests.cluster import Cluster
from tests.conformance import assert_error, assert_response, assert_stream
from tests.gateway.test_routing import routed
from tests.support import sse_events

pytestmark = pytest.mark.e2e

SCRIPTED = "kiln-scripted"
REAL = "smollm2-135m-instruct"
WAIT_S = 60.0  # generous bound on anything that should take a few heartbeats


def post(url: str, body: dict, timeout: float = 60) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=timeout) as client:
        return client.post("/v1/responses", json={"model": SCRIPTED, "input": "hi", "max_output_tokens": 8, **body})


def until(predicate, timeout: float = WAIT_S, what: str = "condition") -> float:
    """Seconds until ``predicate()`` held (bounded; fails the test past ``timeout``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if predicate():
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout}s")


def urls(cluster: Cluster) -> list[str]:
    return [cluster.gateway_url(i) for i in range(cluster.gateways)]


def load(replicas: Cluster, gateway: int) -> int:
    """The shared worker's active + queued as ``gateway`` sees it (from its heartbeats)."""
    workers = replicas.health(gateway)["workers"]
    return workers[0]["active"] + workers[0]["queued"] if workers else -1


def served_by(replicas: Cluster, gateway: int, body: dict, headers: dict | None = None) -> str:
    """The worker ``gateway`` sent one short request to (from its /metrics)."""
    with httpx.Client(base_url=replicas.gateway_url(gateway), timeout=60) as client:
        before = routed(client)
        r = client.post("/v1/responses", json={"model": SCRIPTED, "input": "hi", "max_output_tokens": 4, **body}, headers=headers)
        assert r.status_code == 200, r.text
        after = routed(client)
    grew = [w for w in after if after[w] > before.get(w, 0)]
    assert len(grew) == 1, (before, after)
    return grew[0]


# -- one worker, two gateways, batch 1 + queue 1 -----------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    # 400 tokens at 10 ms: a request that holds its slot for ~4 s, far longer than the others take
    # to arrive; [[hang]] holds one until it is cancelled. Each test leaves both gateways serving.
    args = ["--engine", "scripted", "--scripted-delay", "0.01", "--scripted-reply", "y" * 400, "--max-batch", "1", "--queue-depth", "1"]
    replicas = Cluster(tmp_path_factory.mktemp("replicas"), gateways=2, workers=[[0, 1]], worker_args=args, with_haproxy=False).start()
    yield replicas
    replicas.stop()


def test_both_gateways_serve_through_the_same_worker(shared):
    assert shared.worker_ids(0) == shared.worker_ids(1) and len(shared.worker_ids(0)) == 1
    for url in urls(shared):
        r = post(url, {})
        assert r.status_code == 200, r.text
        assert_response(r.json())
        assert r.json()["status"] == "incomplete"  # 8 of the 400 tokens: max_output_tokens


def _outcome(url: str, streaming: bool) -> str:
    body = {"model": SCRIPTED, "input": "hi", "stream": streaming}  # the whole 400-token reply
    with httpx.Client(base_url=url, timeout=120) as client, client.stream("POST", "/v1/responses", json=body) as r:
        if not streaming:
            r.read()
            if r.status_code == 503:
                assert_error(r.json())
                assert r.json()["error"]["code"] == "server_is_overloaded"
                return "refused"
            assert r.status_code == 200, r.text
            assert_response(r.json())
            return "served"
        assert r.status_code == 200
        names, events = sse_events(r)
    assert_stream(events, names)
    if names[-1] == "response.failed":
        assert events[-1]["response"]["error"]["code"] == "server_is_overloaded", events[-1]
        return "refused"
    assert names[-1] == "response.completed", names
    return "served"


def test_the_worker_admits_batch_plus_queue_whichever_gateway_asks(shared):
    """Four requests at once, two through each gateway (one streaming each): the worker takes one
    running and one queued, refuses the other two cleanly, and nobody hangs."""
    start = threading.Barrier(4)

    def run(gateway: int, streaming: bool) -> str:
        start.wait(30)
        return _outcome(urls(shared)[gateway], streaming)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run, g, s) for g in (0, 1) for s in (False, True)]
        outcomes = sorted(f.result(timeout=120) for f in futures)
    assert outcomes == ["refused", "refused", "served", "served"]
    # Both slots free again: each gateway serves.
    for url in urls(shared):
        assert post(url, {}).status_code == 200


def _hold(url: str, outcomes: list) -> None:
    """A stream that the scripted engine never finishes ([[hang]]): it ends when its gateway dies."""
    body = {"model": SCRIPTED, "input": "[[hang]]", "stream": True}
    try:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(120, connect=10)) as client, client.stream("POST", "/v1/responses", json=body) as r:
            for _ in r.iter_lines():
                pass
        outcomes.append("ended")
    except httpx.HTTPError as exc:  # the gateway went away mid-stream
        outcomes.append(type(exc).__name__)


def test_a_dead_gateways_requests_are_cancelled_and_it_is_served_again_after_restart(shared):
    outcomes: list = []
    holders = [threading.Thread(target=_hold, args=(urls(shared)[0], outcomes)) for _ in range(2)]
    for t in holders:
        t.start()
    # Gateway 1 sees the worker full with gateway 0's requests (one running, one queued)...
    until(lambda: load(shared, 1) == 2, what="full worker in gateway 1's view")
    refused = post(urls(shared)[1], {})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_is_overloaded"

    shared.kill_gateway(0)
    for t in holders:
        t.join(30)
    assert not any(t.is_alive() for t in holders) and "ended" not in outcomes  # failures, not hangs
    # ...until the worker gives up on the dead gateway (its heartbeat timeout is 3 s) and cancels
    # them: the hung requests would otherwise hold both slots forever.
    until(lambda: post(urls(shared)[1], {}).status_code == 200, what="free slot after the gateway died")
    assert "cancelled the requests of a gateway that is gone" in shared.worker_procs[0].log_path.read_text()

    shared.start_gateway(0)  # the same HTTP port and worker socket
    until(lambda: httpx.get(urls(shared)[0] + "/health", timeout=5).status_code in (200, 503), what="restarted gateway up")
    took = until(lambda: len(shared.health(0)["workers"]) == 1, what="worker registered with the restarted gateway")
    assert took < shared.heartbeat_timeout + 5  # re-registration retries every 0.25 s; slack for a busy CI
    r = post(urls(shared)[0], {})
    assert r.status_code == 200, r.text
    assert_response(r.json())
    assert shared.worker_ids(0) == shared.worker_ids(1)


# -- two workers: sticky routing across replicas ------------------------------------------------


def test_every_gateway_sends_a_prompt_cache_key_to_the_same_worker(tmp_path):
    replicas = Cluster(tmp_path, gateways=2, workers=[[0, 1], [0, 1]], worker_args=["--engine", "scripted"], with_haproxy=False).start()
    try:
        assert replicas.worker_ids(0) == replicas.worker_ids(1)
        homes = {}
        for n in range(16):
            key = f"conversation-{n}"
            homes[key] = served_by(replicas, 0, {"prompt_cache_key": key})
            assert served_by(replicas, 1, {"prompt_cache_key": key}) == homes[key], key
            assert served_by(replicas, 0, {"prompt_cache_key": key}) == homes[key], key
        assert len(set(homes.values())) == 2  # the keys spread over both workers
        # A Codex-style session header routes the same way on both.
        session = {"session-id": "codex-session-7"}
        assert served_by(replicas, 0, {}, session) == served_by(replicas, 1, {}, session)
    finally:
        replicas.stop()


# -- the real model through both replicas -------------------------------------------------------


def test_the_real_model_serves_both_gateways_and_shares_its_prefix_cache(tmp_path):
    replicas = Cluster(tmp_path, gateways=2, workers=[[0, 1]], worker_args=["--max-batch", "2"], with_haproxy=False).start(timeout=300)
    try:
        clients = [OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0) for url in urls(replicas)]
        history = [{"role": "user", "content": "My dog is called Pepper and he likes long walks by the river. Reply with OK."}]
        first = clients[0].responses.create(model=REAL, input=history, prompt_cache_key="chat-pepper", max_output_tokens=8, temperature=0)
        assert_response(first.model_dump(mode="json", exclude_unset=True))
        history += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my dog called?"}]
        # Turn 2 through the other replica lands on the worker that holds turn 1's prefix.
        second = clients[1].responses.create(model=REAL, input=history, prompt_cache_key="chat-pepper", max_output_tokens=8, temperature=0)
        assert_response(second.model_dump(mode="json", exclude_unset=True))
        assert second.usage.input_tokens_details.cached_tokens > 0
        events = list(clients[0].responses.create(model=REAL, input="Say hello.", max_output_tokens=8, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete") and events[-1].response.output_text
    finally:
        replicas.stop()


# -- a worker on "another host": its own network namespace, reaching the gateways over a veth ---


@contextmanager
def network_namespace() -> Iterator[tuple[str, str]]:
    """A network namespace joined to this one by a veth pair: (its name, this side's address).
    Skips the test where namespaces cannot be made (not root, no ``ip``, a locked-down sandbox)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("making a network namespace needs root and iproute2")
    tag = secrets.token_hex(3)
    name, host_end, ns_end = f"kiln-test-{tag}", f"kv{tag}h", f"kv{tag}n"
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    subnet = next(f"10.231.{n}" for n in random.sample(range(256), 256) if f" 10.231.{n}." not in used)

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.decode().strip()}")
    try:
        ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        ip("link", "set", ns_end, "netns", name)
        ip("addr", "add", f"{subnet}.1/30", "dev", host_end)
        ip("link", "set", host_end, "up")
        ip("netns", "exec", name, "ip", "addr", "add", f"{subnet}.2/30", "dev", ns_end)
        ip("netns", "exec", name, "ip", "link", "set", ns_end, "up")
        ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, f"{subnet}.1"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)  # takes the veth pair along
        subprocess.run(["ip", "link", "del", host_end], capture_output=True, timeout=30)  # if it was never moved


def test_a_worker_in_its_own_network_namespace_serves_both_gateways(tmp_path):
    with network_namespace() as (namespace, host_address):
        # A worker socket other hosts can reach needs the worker secret (CURVE), which the
        # cluster always sets: the gateways refuse to bind one without it.
        replicas = Cluster(
            tmp_path, gateways=2, workers=[[0, 1]], worker_args=["--engine", "scripted"], with_haproxy=False,
            workers_host=host_address, worker_prefix=["ip", "netns", "exec", namespace],
        )
        replicas.start()
        try:
            assert replicas.worker_ids(0) == replicas.worker_ids(1) and len(replicas.worker_ids(0)) == 1
            for url in urls(replicas):
                r = post(url, {})
                assert r.status_code == 200, r.text
                assert_response(r.json())
            # The worker really is elsewhere: the gateways' loopback HTTP ports are out of its reach.
            port = replicas.ports[0]
            probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)"
            reach = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
            assert reach.returncode != 0 and "ConnectionRefusedError" in reach.stderr
        finally:
            replicas.stop()


# -- discovery: replicas advertised in Redis -----------------------------------------------------


def test_a_worker_discovers_replicas_that_appear_and_go_through_redis(tmp_path):
    import redis

    url = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis unavailable at {url}: {exc}")
    replicas = Cluster(tmp_path, gateways=2, workers=[], worker_args=["--engine", "scripted"], redis_url=url, discover=True, with_haproxy=False)
    gateway = urls(replicas)
    try:
        replicas.start_gateway(0)
        replicas.add_worker([])  # no --gateway: only what Redis advertises
        replicas.wait_until("the worker registered with gateway 0", lambda: replicas.registered(0) == 1, 120)
        assert post(gateway[0], {}).status_code == 200
        replicas.start_gateway(1)  # a replica that appears later is served, no worker restart
        replicas.wait_until("the worker registered with gateway 1", lambda: replicas.registered(1) == 1, 120)
        assert replicas.worker_ids(0) == replicas.worker_ids(1)
        assert post(gateway[1], {}).status_code == 200
        replicas.kill_gateway(1, signal.SIGTERM)  # a clean stop withdraws its address
        log = replicas.worker_procs[0].log_path
        until(lambda: "stopped serving gateway" in log.read_text(), what="worker letting go of the stopped replica")
        assert post(gateway[0], {}).status_code == 200
        replicas.start_gateway(1)  # and back
        replicas.wait_until("the worker back on gateway 1", lambda: replicas.registered(1) == 1, 60)
        assert post(gateway[1], {}).status_code == 200
    finally:
        replicas.stop()
