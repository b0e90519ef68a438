"""Conversations in Redis: a hash per conversation (id, created time, metadata, sizes) and a list
of its items, so that an append is one RPUSH inside one script -- turns written by two replicas
at once both land, in the order Redis ran them. Bounded like the response store (scripts.py), each
organization (the owner its key names) within its share."""

from __future__ import annotations

import time
from typing import Any

from ..conversations import Conversation, ConversationFull, as_input_item, as_resource_item, conversation_limit
from . import scripts
from .codec import dumps, loads
from .connection import RedisContext, guarded


class RedisConversationStore:
    def __init__(self, ctx: RedisContext, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self.ctx = ctx
        self.prefix = ctx.keys.conversations
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.enabled = max_entries > 0
        self.ttl_ms = int(ttl_s * 1000)

    def _limits(self) -> list[int]:
        return [self.max_entries, self.max_bytes]

    def _fits(self, key: str, written: Any) -> None:
        """A write script's answer: below 0, minus the size the conversation would have had."""
        if isinstance(written, int) and written < 0:
            limit, owned = conversation_limit(key, self.max_bytes)
            raise ConversationFull(-written, limit, owned=owned)

    async def _raw(self, key: str) -> tuple[dict[str, str], list[str]] | None:
        found = await self.ctx.run(scripts.CONV_GET, self.prefix, key)
        if not found:
            return None
        flat, items = found
        fields = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
        return fields, [raw.decode() for raw in items]

    @staticmethod
    def _conversation(fields: dict[str, str], items: list[str]) -> Conversation:
        return Conversation(fields["id"], int(fields["created_at"]), loads(fields.get("metadata") or "{}"), [loads(raw) for raw in items])

    @guarded
    async def header(self, key: str) -> Conversation | None:
        flat = await self.ctx.run(scripts.CONV_HEAD, self.prefix, key)
        if not flat:
            return None
        return self._conversation({flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}, [])

    @guarded
    async def create(self, key: str, conv: Conversation) -> bool:
        items = [dumps(as_resource_item(i)) for i in conv.items]
        return bool(await self.ctx.run(scripts.CONV_CREATE, self.prefix, key, conv.id, conv.created_at, dumps(conv.metadata), self.ttl_ms, *self._limits(), *items))

    @guarded
    async def get(self, key: str) -> Conversation | None:
        raw = await self._raw(key)
        return None if raw is None else self._conversation(*raw)

    @guarded
    async def delete(self, key: str) -> bool:
        return bool(await self.ctx.run(scripts.DELETE, self.prefix, key))

    @guarded
    async def set_metadata(self, key: str, metadata: dict[str, str]) -> Conversation | None:
        if not await self.ctx.run(scripts.CONV_METADATA, self.prefix, key, dumps(metadata), *self._limits()):
            return None
        return await self.header(key)

    @guarded
    async def add_items(self, key: str, items: list[dict[str, Any]], *, conversation_id: str | None = None) -> list[dict[str, Any]]:
        added = [as_resource_item(i) for i in items]
        self._fits(key, await self.ctx.run(scripts.CONV_APPEND, self.prefix, key, conversation_id or key, int(time.time()), self.ttl_ms, *self._limits(), *[dumps(i) for i in added]))
        return added

    @guarded
    async def delete_item(self, key: str, item_id: str) -> Conversation | None:
        raw = await self._raw(key)
        if raw is None:
            return None
        stored = next((s for s in raw[1] if (loads(s) or {}).get("id") == item_id), None)
        if stored is None or not await self.ctx.run(scripts.CONV_DELETE_ITEM, self.prefix, key, stored, *self._limits()):
            return None
        return await self.get(key)

    @guarded
    async def transcript(self, key: str) -> list[dict[str, Any]]:
        raw = await self._raw(key)
        return [] if raw is None else [as_input_item(loads(s)) for s in raw[1]]

    @guarded
    async def replace(self, key: str, items: list[dict[str, Any]], *, conversation_id: str | None = None) -> list[dict[str, Any]]:
        resources = [as_resource_item(i) for i in items]
        self._fits(key, await self.ctx.run(scripts.CONV_REPLACE, self.prefix, key, conversation_id or key, int(time.time()), self.ttl_ms, *self._limits(), *[dumps(i) for i in resources]))
        return resources
