"""The maintenance switch (``/admin/maintenance``): while on, every API path answers 503 with
Retry-After.

With one gateway the switch is this process's (``LocalSwitch``). With a Redis (``--redis-url``:
replicas that share their concurrency counters and stores are one deployment) it is one hash in
Redis (``RedisSwitch``), so switching it on any replica switches every replica. A replica reads it
at most once per ``max_age_s`` (default 1 s) rather than on every request; a Redis that cannot be
read fails closed like the rest of the hosted path (503).
"""

from __future__ import annotations

import time
from typing import Protocol

from redis.asyncio import Redis

DEFAULT_RETRY_AFTER = 60


class MaintenanceSwitch(Protocol):
    async def state(self) -> tuple[bool, int]:
        """(on, retry_after seconds)."""

    async def set(self, on: bool, retry_after: int) -> None: ...

    async def close(self) -> None: ...


class LocalSwitch:
    def __init__(self) -> None:
        self._state = (False, DEFAULT_RETRY_AFTER)

    async def state(self) -> tuple[bool, int]:
        return self._state

    async def set(self, on: bool, retry_after: int) -> None:
        self._state = (on, retry_after)

    async def close(self) -> None:
        return None


class RedisSwitch:
    def __init__(self, redis: Redis, key: str, *, max_age_s: float = 1.0) -> None:
        self._redis = redis
        self._key = key
        self._max_age_s = max_age_s
        self._cached: tuple[bool, int] | None = None
        self._read_at = 0.0

    async def state(self) -> tuple[bool, int]:
        """Raises the Redis error when it cannot be read (the caller fails closed)."""
        if self._cached is not None and time.monotonic() - self._read_at < self._max_age_s:
            return self._cached
        on, retry_after = await self._redis.hmget(self._key, ["on", "retry_after"])
        self._cached = (on == b"1", int(retry_after) if retry_after else DEFAULT_RETRY_AFTER)
        self._read_at = time.monotonic()
        return self._cached

    async def set(self, on: bool, retry_after: int) -> None:
        await self._redis.hset(self._key, mapping={"on": "1" if on else "0", "retry_after": retry_after})
        self._cached, self._read_at = (on, retry_after), time.monotonic()

    async def close(self) -> None:
        await self._redis.aclose()
