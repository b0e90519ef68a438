"""Stored responses: what ``GET /v1/responses/{id}`` and ``previous_response_id`` read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .lru import BoundedLRU, approx_bytes


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


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float, ephemeral_ttl_s: float) -> None:
        self._lru: BoundedLRU[StoredResponse] = BoundedLRU(max_entries, max_bytes, ttl_s)
        self.ephemeral_ttl_s = ephemeral_ttl_s

    @property
    def enabled(self) -> bool:
        return self._lru.enabled

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, stored: StoredResponse) -> bool:
        size = approx_bytes(stored.response) + approx_bytes(stored.input_items)
        ttl = self.ephemeral_ttl_s if stored.ephemeral else None
        return self._lru.put(stored.response["id"], stored, size, ttl_s=ttl)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._lru.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._lru.delete(response_id)
