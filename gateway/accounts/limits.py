"""Per-organization concurrency: at most N requests of one organization in flight at once.

``acquire(org_id, limit)`` returns a ``Slot`` or raises the contract's 429 ``rate_limit_exceeded``
(with no rate-limit headers: the contract promises none). The caller releases the slot when the
request is over, on every exit path: ``async with await limiter.acquire(...)``, or
``try/finally: await slot.release()`` when the slot must outlive the handler (a streaming body
releases it when the stream ends). ``release`` is idempotent, so belt-and-braces releases are safe.

This module has the interface and the in-memory limiter (one gateway process); limits_redis.py
shares the counters between gateway replicas.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from kiln.gateway.http.errors import ApiError


def rate_limited(limit: int) -> ApiError:
    """The 429 for the (limit+1)th concurrent request; deliberately without headers."""
    return ApiError(429, f"Your organization already has {limit} requests in flight, its concurrency limit. Retry with exponential backoff.", code="rate_limit_exceeded", headers={})


class Slot:
    """One request's hold on its organization's concurrency; release it exactly once (or more)."""

    def __init__(self, org_id: int, release: Callable[[], Awaitable[None]]) -> None:
        self.org_id = org_id
        self._release = release
        self._released = False

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        await self._release()

    async def __aenter__(self) -> Slot:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.release()


class ConcurrencyLimiter(Protocol):
    async def acquire(self, org_id: int, limit: int) -> Slot:
        """A slot, or ApiError 429 when the organization already has ``limit`` in flight."""

    async def in_flight(self, org_id: int) -> int: ...

    async def close(self) -> None: ...


class InMemoryLimiter:
    """Counters in this process. Check and increment run without an await between them, so no
    lock is needed on one event loop."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}

    async def acquire(self, org_id: int, limit: int) -> Slot:
        current = self._counts.get(org_id, 0)
        if current >= limit:
            raise rate_limited(limit)
        self._counts[org_id] = current + 1
        return Slot(org_id, lambda: self._release(org_id))

    async def _release(self, org_id: int) -> None:
        remaining = self._counts.get(org_id, 0) - 1
        if remaining > 0:
            self._counts[org_id] = remaining
        else:
            self._counts.pop(org_id, None)

    async def in_flight(self, org_id: int) -> int:
        return self._counts.get(org_id, 0)

    async def close(self) -> None:
        self._counts.clear()
