"""Concurrency limits shared by several gateway replicas through Redis.

Each organization has one sorted set; each in-flight request is a member (a random slot id) whose
score is the time its lease ends. Acquire, renew and release are Lua scripts, so "drop expired
leases, count, add" is one atomic step on the server, timed by the server's clock (replica clocks
may disagree). A live slot renews its lease every ``lease/3`` seconds from a background task; a
gateway that crashes stops renewing, so its slots expire after at most ``lease`` seconds instead of
leaking forever. This is the "per-slot key with expiry" idea with one key per organization, which
keeps the count a single O(log n) operation. Release is ZREM: idempotent by nature.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from kiln.gateway.http.errors import ApiError

from .limits import Slot, rate_limited

log = logging.getLogger(__name__)

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1] org set; ARGV: slot id, limit, lease ms. Returns 1 if acquired, 0 if full.
_ACQUIRE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""

# KEYS[1] org set; ARGV: slot id, lease ms. Returns 0 if the lease was already lost.
_RENEW = _NOW_MS + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""

_COUNT = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""


class RedisLimiter:
    """The ConcurrencyLimiter for several replicas; every replica must use the same namespace."""

    def __init__(self, redis: Redis, *, namespace: str = "kiln", lease_seconds: float = 30.0, renew: bool = True) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        self._redis = redis
        self._namespace = namespace
        self._lease_ms = max(1, int(lease_seconds * 1000))
        self._renew_every = lease_seconds / 3
        self._renew = renew  # off only in tests that simulate a crashed replica
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew_script = redis.register_script(_RENEW)
        self._count = redis.register_script(_COUNT)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisLimiter:
        from ..store.redis.connection import connect  # bounded waits: a stalled Redis fails closed fast

        return cls(connect(url), **kwargs)

    def _key(self, org_id: int) -> str:
        return f"{self._namespace}:inflight:{org_id}"

    async def acquire(self, org_id: int, limit: int) -> Slot:
        key = self._key(org_id)
        slot_id = secrets.token_hex(12)
        try:
            acquired = await self._acquire(keys=[key], args=[slot_id, limit, self._lease_ms])
        except RedisError as exc:
            # Fail closed: without the shared counter the limit cannot be honoured.
            log.error("concurrency limiter unavailable: %s", exc)
            raise ApiError(503, "The rate limiter is unavailable; retry with backoff.") from exc
        if not int(acquired):
            raise rate_limited(limit)
        renewal = asyncio.create_task(self._keep_alive(key, slot_id)) if self._renew else None

        async def release() -> None:
            if renewal is not None:
                renewal.cancel()
            try:
                await self._redis.zrem(key, slot_id)
            except RedisError as exc:  # the lease will expire on its own
                log.warning("could not release slot %s of %s: %s", slot_id, key, exc)

        return Slot(org_id, release)

    async def _keep_alive(self, key: str, slot_id: str) -> None:
        while True:
            await asyncio.sleep(self._renew_every)
            try:
                if not int(await self._renew_script(keys=[key], args=[slot_id, self._lease_ms])):
                    log.warning("lease of slot %s of %s was lost", slot_id, key)
                    return
            except RedisError as exc:
                log.warning("could not renew slot %s of %s: %s", slot_id, key, exc)

    async def in_flight(self, org_id: int) -> int:
        return int(await self._count(keys=[self._key(org_id)], args=[]))

    async def close(self) -> None:
        await self._redis.aclose()
