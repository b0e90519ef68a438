"""Stored responses: what ``GET /v1/responses/{id}`` and ``previous_response_id`` read.

``StoredResponse`` is the value every backend keeps; ``MemoryResponseStore`` keeps it in this
process (``--store memory``); ``redis/responses.py`` is the shared one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .lru import OWNER_SHARE, BoundedLRU, approx_bytes


@dataclass
class StoredResponse:
    response: dict[str, Any]
    # The input this response was generated from, history included, in rendering order.
    input_items: list[dict[str, Any]]
    # A store:false background job's final object: readable by polling, never chainable.
    ephemeral: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def chainable(self) -> bool:
        return not self.ephemeral

    @property
    def owner(self) -> Any:
        return self.extra.get("owner")

    def size(self) -> int:
        """What it costs against the byte budget: its response and input items as JSON."""
        return approx_bytes(self.response) + approx_bytes(self.input_items)


class MemoryResponseStore:
    """The ResponseStore of one process: a byte-, entry- and TTL-bounded LRU in which each
    organization (the response's owner) keeps at most ``OWNER_SHARE`` of the entries and bytes,
    so that one filling the store evicts its own responses, never another's."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float, ephemeral_ttl_s: float) -> None:
        self._lru: BoundedLRU[StoredResponse] = BoundedLRU(max_entries, max_bytes, ttl_s, owner_share=OWNER_SHARE)
        self.ephemeral_ttl_s = ephemeral_ttl_s
        self.enabled = max_entries > 0
        self.max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def size_of(self, stored: StoredResponse) -> int:
        return stored.size()

    async def put(self, stored: StoredResponse) -> bool:
        ttl = self.ephemeral_ttl_s if stored.ephemeral else None
        return self._lru.put(stored.response["id"], stored, stored.size(), ttl_s=ttl, owner=stored.owner)

    async def get(self, response_id: str) -> StoredResponse | None:
        return self._lru.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self._lru.delete(response_id)

    async def stats(self) -> dict[str, int]:
        return {"entries": len(self._lru), "bytes": self._lru.bytes, "max_bytes": self._lru.max_bytes}
