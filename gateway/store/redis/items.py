"""The item index in Redis: a hash of "owner|item id" -> holder, and a sorted set by insertion
that bounds it (the oldest forgotten first), written in one script per add."""

from __future__ import annotations

from typing import Any

from ..items import DEFAULT_MAX_ENTRIES
from . import scripts
from .connection import RedisContext, guarded
from .connection import text as _text


class RedisItemIndex:
    def __init__(self, ctx: RedisContext, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.ctx = ctx
        self.prefix = ctx.keys.items
        self.max_entries = max_entries

    @staticmethod
    def _field(owner: Any, item_id: str) -> str:
        return f"{owner}|{item_id}"

    @guarded
    async def add(self, owner: Any, items: list[dict[str, Any]], holder: tuple[str, str]) -> None:
        fields = [self._field(owner, i["id"]) for i in items if isinstance(i.get("id"), str) and i["id"]]
        if fields:
            await self.ctx.run(scripts.ITEMS_ADD, self.prefix, self.max_entries, "\t".join(holder), *fields)

    @guarded
    async def lookup(self, owner: Any, item_id: str) -> tuple[str, str] | None:
        raw = await self.ctx.redis.hget(f"{self.prefix}:h", self._field(owner, item_id))
        if raw is None:
            return None
        kind, _, key = _text(raw).partition("\t")
        return kind, key
