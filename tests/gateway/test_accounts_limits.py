"""Per-organization concurrency: in memory, and in Redis shared by two simulated replicas."""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest

from kiln.gateway.accounts.limits import InMemoryLimiter
from kiln.gateway.http.errors import ApiError

REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


async def _redis_limiter(namespace: str, **kwargs):
    """A Redis-backed limiter with its own connection, as one gateway replica has."""
    redis_limits = pytest.importorskip("kiln.gateway.accounts.limits_redis")
    from redis.asyncio import Redis

    probe = Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        await probe.ping()
    except Exception as exc:
        pytest.skip(f"Redis unavailable at {REDIS_URL}: {exc}")
    finally:
        await probe.aclose()
    return redis_limits.RedisLimiter.from_url(REDIS_URL, namespace=namespace, **kwargs)


def _namespace() -> str:
    return "kiln-test-" + secrets.token_hex(6)


@pytest.fixture(params=["memory", "redis"])
async def limiters(request):
    """(replica_a, replica_b); in memory both names are the same limiter."""
    if request.param == "memory":
        limiter = InMemoryLimiter()
        yield limiter, limiter
        await limiter.close()
        return
    namespace = _namespace()
    pair = (await _redis_limiter(namespace), await _redis_limiter(namespace))
    yield pair
    for limiter in pair:
        await limiter.close()


def _assert_429(err: pytest.ExceptionInfo[ApiError]) -> None:
    assert err.value.status == 429
    assert err.value.code == "rate_limit_exceeded"
    assert err.value.headers == {}  # the contract: no rate-limit headers
    assert err.value.body()["error"]["type"] == "rate_limit_error"


async def test_429_at_n_plus_one_across_replicas(limiters):
    a, b = limiters
    slots = [await (a if i % 2 else b).acquire(1, 3) for i in range(3)]
    for limiter in (a, b):
        with pytest.raises(ApiError) as err:
            await limiter.acquire(1, 3)
        _assert_429(err)
    other_org = await b.acquire(2, 3)  # limits are per organization
    assert await a.in_flight(1) == 3
    await slots[0].release()
    again = await b.acquire(1, 3)
    for slot in (*slots, other_org, again):
        await slot.release()
    assert await a.in_flight(1) == 0 and await b.in_flight(2) == 0


async def test_release_is_idempotent(limiters):
    a, b = limiters
    first = await a.acquire(7, 2)
    second = await b.acquire(7, 2)
    await first.release()
    await first.release()  # must not free the other request's slot
    assert await a.in_flight(7) == 1
    await second.release()
    assert await b.in_flight(7) == 0


async def test_released_on_every_exit_path(limiters):
    a, _ = limiters

    async def handler(outcome: str) -> None:
        async with await a.acquire(9, 1):
            if outcome == "error":
                raise RuntimeError("model server failed")
            if outcome == "cancel":
                await asyncio.sleep(10)

    await handler("ok")
    with pytest.raises(RuntimeError):
        await handler("error")
    task = asyncio.create_task(handler("cancel"))
    await asyncio.sleep(0.05)
    assert await a.in_flight(9) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await a.in_flight(9) == 0
    async with await a.acquire(9, 1):
        pass


async def test_crashed_replica_slots_expire_with_their_lease():
    namespace = _namespace()
    # The "crashed" replica never renews nor releases its slot.
    crashed = await _redis_limiter(namespace, lease_seconds=0.3, renew=False)
    live_a = await _redis_limiter(namespace, lease_seconds=0.3)
    live_b = await _redis_limiter(namespace, lease_seconds=0.3)
    try:
        await crashed.acquire(5, 1)
        with pytest.raises(ApiError):
            await live_a.acquire(5, 1)
        await asyncio.sleep(0.4)
        held = await live_a.acquire(5, 1)  # the lease ran out
        await asyncio.sleep(0.5)  # longer than a lease: renewal keeps it alive
        with pytest.raises(ApiError) as err:
            await live_b.acquire(5, 1)
        _assert_429(err)
        await held.release()
        assert await live_b.in_flight(5) == 0
    finally:
        for limiter in (crashed, live_a, live_b):
            await limiter.close()
