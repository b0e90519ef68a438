"""Faults in the scale-out topology (issue 18, "What must be shown"): a gateway replica, a worker
and Redis lost while HAProxy, two gateways with ``--store redis`` and two workers on both keep
running. The client is the OpenAI SDK through HAProxy (``X-Kiln-Replica`` says which replica
answered; tests/cluster.py ``aim``/``on`` choose it).

The model's words do not matter here, so the workers run the scripted engine (named as such:
``kiln-scripted``; its ``[[hang]]`` prompt holds a request open until it is cancelled). Redis is a
``redis-server`` of this module's own on a free port (tests/redis_support.py, append-only with
fsync on every write), so that a test can kill it and start it again.

Not repeated here: that a worker cancels a dead gateway's requests and registers again when the
gateway restarts (tests/e2e/test_gateway_replicas.py shows exactly that), and that the real model's
streams on a killed replica are cut (tests/e2e/test_cluster.py). The background job polled and
cancelled through the other replica is here because hosted mode (test_cluster.py's) refuses
``background``.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.cluster import Cluster, haproxy
from tests.conformance import assert_error, assert_response
from tests.redis_support import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(haproxy() is None, reason="haproxy is not installed (./dev setup installs it where apt is available)")]

SCRIPTED = "kiln-scripted"
# The job lease (--responses-background-lease-secs, docs/deploy-state.md "Background jobs across
# replicas"): a dead replica's jobs end `failed` within it of the last renewal. Short, so the test
# is; the sweep that ends them runs every quarter lease.
LEASE_S = 4
WAIT_S = 60.0  # generous bound on anything that should take a few heartbeats
REDIS_DOWN_S = 10.0  # how long the Redis test keeps Redis away (the fault itself, not a wait)


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    redis = RedisServer(tmp).start()
    cluster = Cluster(
        tmp, gateways=2, workers=[[0, 1], [0, 1]], store="redis", redis_url=redis.url,
        gateway_args=["--responses-background-lease-secs", str(LEASE_S)], worker_args=["--engine", "scripted", "--max-batch", "8"],
    )
    cluster.redis = redis
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        redis.stop()


def _sdk(cluster: Cluster) -> OpenAI:
    return OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=openai.Timeout(120, connect=10))


def until(predicate, what: str, timeout: float = WAIT_S) -> float:
    """Seconds until ``predicate()`` held; fails the test past ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if predicate():
                return time.monotonic() - start
        except (httpx.HTTPError, openai.APIError):
            pass
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout}s")


def _create(cluster: Cluster, replica: str, **body):
    response = cluster.on(replica, _sdk(cluster).responses.with_raw_response.create, model=SCRIPTED, **{"input": "hi", "max_output_tokens": 4, **body})
    assert_response(response.model_dump(mode="json", exclude_unset=True))
    return response


def _whole(cluster: Cluster) -> None:
    """Both gateways up with both workers, and in HAProxy's rotation."""
    cluster.wait_ready(WAIT_S * 2)


# -- a background job across replicas ---------------------------------------------------------


def test_a_background_job_is_polled_and_cancelled_through_the_other_replica_scripted(faults):
    """Here rather than in test_cluster.py: hosted mode refuses ``background``."""
    sdk = _sdk(faults)
    owner, poller = faults.names
    job = _create(faults, owner, input="[[hang]]", background=True)  # runs until cancelled
    assert job.status in ("queued", "in_progress")
    until(lambda: faults.on(poller, sdk.responses.with_raw_response.retrieve, job.id).status == "in_progress", "job in progress, seen from the other replica")
    cancelled = faults.on(poller, sdk.responses.with_raw_response.cancel, job.id)
    assert_response(cancelled.model_dump(mode="json", exclude_unset=True))
    assert cancelled.status == "cancelled"
    # Both replicas agree: the owner stopped its worker request and stored the cancelled job.
    for replica in (owner, poller):
        assert faults.on(replica, sdk.responses.with_raw_response.retrieve, job.id).status == "cancelled"


# -- a gateway replica killed ------------------------------------------------------------------


def test_a_killed_replica_cuts_its_clients_promptly_and_its_background_jobs_fail_within_the_lease_scripted(faults):
    sdk = _sdk(faults)
    victim, survivor = faults.names
    job = _create(faults, victim, input="[[hang]]", background=True)  # [[hang]] stops after 3 tokens: 4 is never reached
    until(lambda: faults.on(survivor, sdk.responses.with_raw_response.retrieve, job.id).status == "in_progress", "job in progress")

    faults.aim(victim)
    with sdk.responses.with_streaming_response.create(model=SCRIPTED, input="[[hang]]", stream=True) as raw:
        assert raw.headers["x-kiln-replica"] == victim
        events = iter(raw.parse())
        for event in events:
            if event.type == "response.output_text.delta":
                break
        killed = time.monotonic()
        faults.kill_gateway(faults.names.index(victim))
        # The stream in flight fails, promptly: a cut, never a hang or a made-up ending.
        with pytest.raises((httpx.HTTPError, openai.APIError)):
            for event in events:
                assert event.type not in ("response.completed", "response.incomplete")
        assert time.monotonic() - killed < 30

    # The survivor keeps serving: new requests reach it at once (a refused connection is retried
    # on the other replica), stored ones included.
    for _ in range(3):
        raw = sdk.responses.with_raw_response.create(model=SCRIPTED, input="hi", max_output_tokens=4)
        assert raw.headers["x-kiln-replica"] == survivor and raw.parse().status in ("completed", "incomplete")

    # The dead replica's job is taken over and ended `failed`, within the lease of its last
    # renewal (plus a sweep interval and slack for a busy CI), never stuck in progress.
    def failed() -> bool:
        return sdk.responses.retrieve(job.id).status == "failed"

    until(failed, "the dead replica's job failed", timeout=WAIT_S)
    took = time.monotonic() - killed
    assert took < LEASE_S * 1.25 + 10, took
    final = sdk.responses.retrieve(job.id)
    assert_response(final.model_dump(mode="json", exclude_unset=True))
    assert final.error is not None and final.error.code == "server_error"

    faults.start_gateway(faults.names.index(victim))  # the runbook's "restart it"
    _whole(faults)
    # Both serve again, within a bound rather than on the next two requests: a restarted replica
    # may take a request or two more while HAProxy settles. Failing, say what answered.
    answered: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while set(answered[-4:]) != set(faults.names):
        assert time.monotonic() < deadline, (answered, faults.balancer_status(), faults.balancer.log() if faults.balancer else "")
        answered.append(sdk.responses.with_raw_response.create(model=SCRIPTED, input="hi", max_output_tokens=4).headers["x-kiln-replica"])


# -- a worker killed -----------------------------------------------------------------------------


def _served_by(cluster: Cluster, gateway: int, key: str) -> str:
    """The worker gateway `gateway` sent one request with `key` to, by the tag its /metrics and
    /health both show (neither names a worker id)."""
    before = cluster.routed_by_worker(gateway)
    r = httpx.post(cluster.gateway_url(gateway) + "/v1/responses", json={"model": SCRIPTED, "input": "hi", "max_output_tokens": 4, "prompt_cache_key": key, "store": False}, timeout=60)
    assert r.status_code == 200, r.text
    after = cluster.routed_by_worker(gateway)
    grew = [w for w in after if after[w] > before.get(w, 0)]
    assert len(grew) == 1, (before, after)
    return grew[0]


def test_a_killed_worker_leaves_both_replicas_within_the_heartbeat_timeout_and_rejoins_both_scripted(faults):
    ids = faults.worker_ids(0)
    assert faults.worker_ids(1) == ids and len(ids) == 2
    victim = next(p for p in faults.worker_procs if p.alive())
    victim.kill()  # SIGKILL: no goodbye, only silence
    took = until(lambda: faults.registered(0) == faults.registered(1) == 1, "both replicas dropping the dead worker")
    assert took < faults.heartbeat_timeout + 3, took
    survivor = faults.worker_ids(0)
    assert faults.worker_ids(1) == survivor
    # Every session now goes to the survivor, on both replicas, and none fails.
    keys = [f"session-{n}" for n in range(8)]
    assert {_served_by(faults, g, k) for g in (0, 1) for k in keys} == set(survivor)

    faults.add_worker([0, 1])  # restarted: a new process, registering with both replicas
    until(lambda: faults.registered(0) == faults.registered(1) == 2, "the restarted worker on both replicas")
    assert faults.worker_ids(0) == faults.worker_ids(1)
    (newcomer,) = set(faults.worker_ids(0)) - set(survivor)
    # Both replicas route to it again, and agree on which sessions are its.
    homes = {k: _served_by(faults, 0, k) for k in keys}
    assert all(_served_by(faults, 1, k) == homes[k] for k in keys)
    assert newcomer in homes.values()


# -- Redis stopped ---------------------------------------------------------------------------------


def test_redis_away_for_ten_seconds_is_503s_then_recovery_with_nothing_acknowledged_lost_scripted(faults):
    sdk = _sdk(faults)
    _whole(faults)
    gateways = [p.process.pid for p in faults.gateway_procs if p is not None and p.process is not None]
    acknowledged = [_create(faults, faults.names[n % 2], input=f"remember {n}") for n in range(4)]
    chain = _create(faults, faults.names[0], input="start a chain")

    faults.redis.kill()  # SIGKILL: whatever Redis acknowledged is in its append-only file
    stopped = time.monotonic()
    try:
        for replica in faults.names:
            for call in (lambda: sdk.responses.create(model=SCRIPTED, input="hi", max_output_tokens=4),
                         lambda: sdk.responses.retrieve(acknowledged[0].id),
                         lambda: sdk.responses.create(model=SCRIPTED, input="next", previous_response_id=chain.id, max_output_tokens=4)):
                faults.aim(replica)
                started = time.monotonic()
                with pytest.raises(openai.APIStatusError) as refused:
                    call()
                assert time.monotonic() - started < 10  # a clear refusal, never a hang
                r = refused.value.response
                assert r.status_code == 503 and r.headers["x-kiln-replica"] == replica and r.headers["retry-after"]
                assert_error(r.json())
                assert "store is unavailable" in r.json()["error"]["message"] and "redis" not in r.text.lower()
            # What needs no store still works, and the replica stays in rotation.
            assert _create(faults, replica, store=False).status in ("completed", "incomplete")
        assert set(faults.balancer_status().values()) == {"UP"}
        time.sleep(max(0.0, REDIS_DOWN_S - (time.monotonic() - stopped)))  # the outage lasts 10 s
    finally:
        faults.redis.start()

    # Recovery without restarts: the same gateway processes answer stored requests again.
    until(lambda: sdk.responses.with_raw_response.create(model=SCRIPTED, input="back", max_output_tokens=4).status_code == 200, "a stored create after Redis returned")
    assert [p.process.pid for p in faults.gateway_procs if p is not None and p.process is not None] == gateways
    for response in acknowledged:
        for replica in faults.names:
            got = faults.on(replica, sdk.responses.with_raw_response.retrieve, response.id)
            assert got.id == response.id and got.output_text == response.output_text and got.status == response.status
    continued = _create(faults, faults.names[1], input="next", previous_response_id=chain.id)
    assert continued.usage.input_tokens > chain.usage.input_tokens
