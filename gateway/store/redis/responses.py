"""Stored responses in Redis: one key per response (the response and its input items in one
value, so a response is never half written), LRU by bytes over the whole deployment with each
organization within its share (scripts.py), TTL as Redis expiry."""

from __future__ import annotations

from typing import Any

from ..responses import StoredResponse
from . import scripts
from .codec import dumps, loads
from .connection import RedisContext, guarded


def encode(stored: StoredResponse) -> str:
    return dumps({"response": stored.response, "input_items": stored.input_items, "ephemeral": stored.ephemeral, "owner": stored.owner})


def decode(raw: bytes | str | None) -> StoredResponse | None:
    value = loads(raw)
    if value is None:
        return None
    return StoredResponse(value["response"], value["input_items"], ephemeral=bool(value.get("ephemeral")), extra={"owner": value.get("owner")})


class RedisResponseStore:
    def __init__(self, ctx: RedisContext, max_entries: int, max_bytes: int, ttl_s: float, ephemeral_ttl_s: float) -> None:
        self.ctx = ctx
        self.prefix = ctx.keys.responses
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.enabled = max_entries > 0
        self.ttl_s = ttl_s
        self.ephemeral_ttl_s = ephemeral_ttl_s

    def size_of(self, stored: StoredResponse) -> int:
        return stored.size()

    def put_args(self, stored: StoredResponse) -> list[Any]:
        """The PUT arguments after the prefix and id: value, size, ttl ms, limits, owner (also
        what ending a background job stores)."""
        ttl = self.ephemeral_ttl_s if stored.ephemeral else self.ttl_s
        owner = "" if stored.owner is None else str(stored.owner)
        return [encode(stored), stored.size(), int(ttl * 1000), self.max_entries, self.max_bytes, owner]

    @guarded
    async def put(self, stored: StoredResponse) -> bool:
        return bool(await self.ctx.run(scripts.PUT, self.prefix, stored.response["id"], *self.put_args(stored)))

    @guarded
    async def get(self, response_id: str) -> StoredResponse | None:
        return decode(await self.ctx.run(scripts.GET, self.prefix, response_id))

    @guarded
    async def delete(self, response_id: str) -> bool:
        return bool(await self.ctx.run(scripts.DELETE, self.prefix, response_id))

    @guarded
    async def stats(self) -> dict[str, int]:
        entries, used = await self.ctx.run(scripts.STATS, self.prefix)
        return {"entries": int(entries), "bytes": int(used), "max_bytes": self.max_bytes}
