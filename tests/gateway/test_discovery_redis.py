"""Gateway replicas advertised in Redis under a lease, as workers read them (a real Redis; the
test is skipped without one, like the other Redis tests)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kiln.gateway.pool.advertise import Advertiser
from kiln.protocol.discovery import live_addresses
from kiln.worker.discovery import RedisDiscovery

from tests.redis_support import REDIS_URL, new_namespace, shared_redis_url


@pytest.fixture
def namespace():
    shared_redis_url()  # skips the test when CI's Redis is not there
    return new_namespace()


def test_only_sane_addresses_are_taken():
    members = [b"tcp://10.0.0.1:5555", "ipc:///run/kiln/w.sock", b"http://evil", b"tcp://" + b"x" * 600]
    assert live_addresses(members) == {"tcp://10.0.0.1:5555", "ipc:///run/kiln/w.sock"}


async def test_an_advertisement_appears_lapses_without_renewal_and_is_withdrawn_on_stop(namespace):
    reader = RedisDiscovery(REDIS_URL, namespace)
    one = Advertiser.from_url(REDIS_URL, namespace, "tcp://10.0.0.1:5555", lease_s=0.5)
    two = Advertiser.from_url(REDIS_URL, namespace, "tcp://10.0.0.2:5555", lease_s=30)
    try:
        await one.renew()  # a replica that then crashes: it never renews
        await two.start()
        deadline = time.monotonic() + 10
        while await asyncio.to_thread(reader.read) != {"tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"}:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        while await asyncio.to_thread(reader.read) != {"tcp://10.0.0.2:5555"}:  # the lease ran out
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        await two.stop()  # a clean stop withdraws the address at once
        assert await asyncio.to_thread(reader.read) == frozenset()
    finally:
        for advertiser in (one, two):
            await advertiser.stop()
        reader.stop()
