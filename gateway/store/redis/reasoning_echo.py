"""The reasoning echo store in Redis: one entry per key in a byte-bounded store (scripts.py),
looked up with one MGET per request. Best effort, like its purpose: a Redis that is down makes
it forget and skip, never fail a request."""

from __future__ import annotations

import logging
from typing import Any

from ..reasoning_echo import NO_ENTRY_LIMIT, echo_entries, reinsert, wanted_keys
from . import scripts
from .codec import dumps, loads
from .connection import BACKEND_ERRORS, RedisContext

log = logging.getLogger("kiln.gateway.store")


class RedisReasoningEcho:
    def __init__(self, ctx: RedisContext, max_bytes: int) -> None:
        self.ctx = ctx
        self.prefix = ctx.keys.echo
        self.max_bytes = max_bytes

    async def remember(self, output: list[dict[str, Any]], owner: Any = None) -> None:
        entry = echo_entries(output, owner) if self.max_bytes > 0 else None
        if entry is None:
            return
        keys, reasoning = entry
        value = dumps(reasoning)
        tenant = "" if owner is None else str(owner)  # within its share of the bytes (scripts.py)
        try:
            for key in keys:
                await self.ctx.run(scripts.PUT, self.prefix, key, value, len(value), 0, NO_ENTRY_LIMIT, self.max_bytes, tenant)
        except BACKEND_ERRORS as exc:
            log.warning("reasoning echo not kept: redis unavailable", extra={"error": str(exc)})

    async def restore(self, items: list[dict[str, Any]], owner: Any = None) -> list[dict[str, Any]]:
        keys = wanted_keys(items, owner) if self.max_bytes > 0 else []
        if not keys:
            return items
        try:
            values = await self.ctx.redis.mget([self.ctx.keys.data(self.prefix, k) for k in keys])
        except BACKEND_ERRORS as exc:
            log.warning("reasoning echo skipped: redis unavailable", extra={"error": str(exc)})
            return items
        return reinsert(items, {k: loads(v) for k, v in zip(keys, values, strict=False) if v is not None}, owner)
