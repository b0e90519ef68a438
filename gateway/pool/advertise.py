"""This replica's worker address in Redis, under a lease, for workers that discover gateways.

Started by the app's lifespan when ``--advertise-workers`` is set (``--redis-url`` is then
required, see cli.py). The lease is renewed every third of its length from a background task, and
withdrawn on a clean stop; a replica that crashes simply stops renewing and drops out of the
workers' view within one lease (kiln.protocol.discovery). Redis being down only delays renewals:
workers keep serving a gateway that still answers their heartbeats whatever Redis says.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kiln.protocol.discovery import ADVERTISE, ADVERTISE_LEASE_S, gateways_key

from ..lifecycle.tasks import stop_tasks

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from ..settings import Settings

log = logging.getLogger("kiln.gateway.pool.advertise")


def advertiser_for(settings: Settings) -> Advertiser | None:
    """The advertiser ``--advertise-workers`` asks for, else None (redis is imported only then)."""
    if not settings.advertise_workers or not settings.redis_url:
        return None
    return Advertiser.from_url(settings.redis_url, settings.redis_namespace, settings.advertise_workers)


class Advertiser:
    def __init__(self, redis: Redis, namespace: str, address: str, *, lease_s: float = ADVERTISE_LEASE_S) -> None:
        self._redis = redis
        self._key = gateways_key(namespace)
        self.address = address
        self._lease_ms = max(1, int(lease_s * 1000))
        self._every_s = lease_s / 3
        self._script = redis.register_script(ADVERTISE)
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    @classmethod
    def from_url(cls, url: str, namespace: str, address: str, **kwargs: float) -> Advertiser:
        from redis.asyncio import Redis

        return cls(Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5), namespace, address, **kwargs)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._renew_loop(), name="kiln-advertise")

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        await stop_tasks([self._task])
        self._task = None
        from redis.exceptions import RedisError

        try:
            await self._redis.zrem(self._key, self.address)  # workers drop us at their next look
        except (RedisError, OSError) as exc:
            log.warning("could not withdraw the worker address from Redis: %s", type(exc).__name__)
        await self._redis.aclose()

    async def renew(self) -> None:
        await self._script(keys=[self._key], args=[self.address, self._lease_ms])

    async def _renew_loop(self) -> None:
        from redis.exceptions import RedisError

        failing = False
        while True:
            try:
                await self.renew()
                if failing:
                    log.warning("advertising the worker address in Redis again")
                failing = False
            except (RedisError, OSError) as exc:
                if not failing:  # once per outage, not every few seconds
                    log.warning("cannot advertise the worker address in Redis: %s", type(exc).__name__)
                failing = True
            await asyncio.sleep(self._every_s)
