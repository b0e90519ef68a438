"""Conversations: what ``/v1/conversations`` manages and what ``conversation`` on create reads.

One conversation is one entry of a byte-, entry- and TTL-bounded LRU (the spec's conversation
store flags), keyed by the owner and the id so that tenants never share one:
``MemoryConversationStore`` here, ``redis/conversations.py`` for several replicas. Items are kept in the
form the Conversations API lists them (each with an ``id`` and a ``status``, message content as
parts), which is also the form ``item_reference`` resolves to; ``transcript`` gives them back as
input items to render.

A conversation named on create that does not exist is started then (Kiln's ad-hoc ids, which the
spec's transcript store always accepted); conversations made with ``POST /v1/conversations`` have
``conv_…`` ids.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..http.errors import ApiError
from .lru import OWNER_SHARE, BoundedLRU, approx_bytes

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs", "compaction": "cmp"}


def new_conversation_id() -> str:
    return "conv_" + uuid.uuid4().hex


def as_resource_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input or output item as a stored item resource: an id, a status, content as parts."""
    kind = item.get("type") or ("message" if "role" in item else None)
    out = {**item, "type": kind}
    if kind == "message" and isinstance(out.get("content"), str):
        part = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": out["content"]}]
    if kind == "message":
        out["content"] = [_with_part_fields(p) for p in out.get("content") or []]
    if not out.get("id"):
        out["id"] = f"{_ID_PREFIX.get(kind or '', 'item')}_{uuid.uuid4().hex}"
    if kind in ("message", "function_call", "function_call_output", "reasoning") and not out.get("status"):
        out["status"] = "completed"
    return out


def _with_part_fields(part: Any) -> Any:
    """``output_text`` parts carry ``annotations`` (the item schemas require it)."""
    if isinstance(part, dict) and part.get("type") == "output_text" and "annotations" not in part:
        return {**part, "annotations": []}
    return part


def as_input_item(item: dict[str, Any]) -> dict[str, Any]:
    """A stored item as an input item to render (``status`` is an output-only field)."""
    return {k: v for k, v in item.items() if k != "status"}


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    # What ``items`` weigh as JSON, kept up to date by the memory store so that an append costs
    # the bytes it adds, not a recount of the whole conversation (None: not counted yet).
    items_bytes: int | None = field(default=None, repr=False, compare=False)

    def resource(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": dict(self.metadata)}

    def find(self, item_id: str) -> dict[str, Any] | None:
        return next((i for i in self.items if i.get("id") == item_id), None)


def key_owner(key: str) -> str | None:
    """The organization of a conversation key (``history.conversation_key``: ``owner:id``, or the
    bare id locally, where one tenant owns everything)."""
    owner, sep, _ = key.partition(":")
    return owner if sep else None


class ConversationFull(ApiError):
    """These items would make the conversation larger than one conversation may be (the
    organization's share of the conversation store, or the store's whole byte budget).

    Refused before anything is written: kept, the conversation would have been the entry its own
    organization's share evicts, and the client's 200 would have been followed by a 404."""

    def __init__(self, size: int, limit: int, *, owned: bool, param: str = "items") -> None:
        whose = "this organization's share of the conversation store" if owned else "the conversation store's byte budget"
        super().__init__(400, f"The conversation would be {size} bytes with these items, larger than {whose} ({limit} bytes).", param=param)
        self.size, self.limit, self.owned = size, limit, owned


def conversation_limit(key: str, max_bytes: int) -> tuple[int, bool]:
    """The most bytes the conversation under ``key`` may hold, and whether that is its
    organization's share (a key naming an owner) rather than the whole store's budget."""
    owned = key_owner(key) is not None
    return (int(OWNER_SHARE * max_bytes) if owned else max_bytes), owned


class MemoryConversationStore:
    """The ConversationStore of one process: one LRU entry per conversation."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self._lru: BoundedLRU[Conversation] = BoundedLRU(max_entries, max_bytes, ttl_s, owner_of=key_owner, owner_share=OWNER_SHARE)
        self.enabled = max_entries > 0
        self.max_bytes = max_bytes

    async def header(self, key: str) -> Conversation | None:
        conv = self._lru.get(key)
        return None if conv is None else Conversation(conv.id, conv.created_at, dict(conv.metadata))

    def _keep(self, key: str, conv: Conversation) -> None:
        self._lru.resize(key, conv, conversation_size(conv))

    def _fits(self, key: str, size: int) -> None:
        """Raise ConversationFull when a conversation of ``size`` bytes may not be kept here."""
        limit, owned = conversation_limit(key, self._lru.max_bytes)
        if size > limit:
            raise ConversationFull(size, limit, owned=owned)

    # -- the Conversations API ---------------------------------------------------------------------
    async def create(self, key: str, conv: Conversation) -> bool:
        """Keep a new conversation; False when it does not fit the byte budget."""
        return self._lru.put(key, conv, conversation_size(conv))

    async def get(self, key: str) -> Conversation | None:
        return self._lru.get(key)

    async def delete(self, key: str) -> bool:
        return self._lru.delete(key)

    async def set_metadata(self, key: str, metadata: dict[str, str]) -> Conversation | None:
        conv = self._lru.get(key)
        if conv is not None:
            conv.metadata = dict(metadata)
            self._keep(key, conv)
        return conv

    async def add_items(self, key: str, items: list[dict[str, Any]], *, conversation_id: str | None = None) -> list[dict[str, Any]]:
        """Append items (as resources), starting the conversation if it does not exist."""
        conv = self._lru.get(key)
        if conv is None:
            conv = Conversation(conversation_id or key, int(time.time()))
        added = [as_resource_item(i) for i in items]
        grows_by = items_bytes(added) - 1
        self._fits(key, conversation_size(conv) + grows_by)
        if conv.items_bytes is not None:
            conv.items_bytes += grows_by
        conv.items.extend(added)
        self._keep(key, conv)
        return added

    async def delete_item(self, key: str, item_id: str) -> Conversation | None:
        conv = self._lru.get(key)
        if conv is None or conv.find(item_id) is None:
            return None
        kept = [i for i in conv.items if i.get("id") != item_id]
        if conv.items_bytes is not None:
            conv.items_bytes -= items_bytes([i for i in conv.items if i.get("id") == item_id]) - 1
        conv.items = kept
        self._keep(key, conv)
        return conv

    # -- what create reads and writes ------------------------------------------------------------
    async def transcript(self, key: str) -> list[dict[str, Any]]:
        conv = self._lru.get(key)
        return [as_input_item(i) for i in conv.items] if conv is not None else []

    async def replace(self, key: str, items: list[dict[str, Any]], *, conversation_id: str | None = None) -> list[dict[str, Any]]:
        """Swap the items for a compacted history (metadata and creation time stay)."""
        conv = self._lru.get(key) or Conversation(conversation_id or key, int(time.time()))
        replaced = Conversation(conv.id, conv.created_at, conv.metadata, [as_resource_item(i) for i in items])
        self._fits(key, conversation_size(replaced))  # counts the new items once, kept below
        conv.items, conv.items_bytes = replaced.items, replaced.items_bytes
        self._keep(key, conv)
        return list(conv.items)


def items_bytes(items: list[dict[str, Any]]) -> int:
    """What a list of items weighs as JSON: each item, a separator each, the brackets (one
    counted per item, so that counts of parts add up: the list's weight is 1 + each item's)."""
    return 1 + sum(approx_bytes(i) + 1 for i in items)


def conversation_size(conv: Conversation) -> int:
    """What a conversation costs against the byte budget (its items and metadata as JSON). The
    items are weighed once; the memory store keeps the count as they change."""
    if conv.items_bytes is None:
        conv.items_bytes = items_bytes(conv.items)
    return conv.items_bytes + approx_bytes(conv.metadata) + 64
