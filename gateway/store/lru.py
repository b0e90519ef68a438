"""A byte- and entry-bounded LRU map with a TTL: the shape shared by the response and
conversation stores (spec: Storage Flags)."""

from __future__ import annotations

import heapq
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

V = TypeVar("V")


def approx_bytes(value: Any) -> int:
    """Serialized JSON size: what a value costs to keep, near enough for a budget."""
    return len(json.dumps(value, separators=(",", ":"), default=str))


@dataclass
class _Entry(Generic[V]):
    value: V
    size: int
    expires_at: float | None


class BoundedLRU(Generic[V]):
    """``max_entries`` 0 means nothing is kept; ``max_bytes`` 0 means an entry is evicted as
    soon as it is put; ``ttl_s`` 0 means entries never expire."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, _Entry[V]] = OrderedDict()
        # (expires_at, key) of every entry with a TTL, soonest first. Items of deleted or
        # replaced entries stay until they surface (or the heap is rebuilt): expiry is then
        # O(log n) per put instead of a scan of the whole store.
        self._expiry: list[tuple[float, str]] = []
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def put(self, key: str, value: V, size: int, *, ttl_s: float | None = None) -> bool:
        """Keep ``value``; False when it could not be kept (store off or larger than the budget)."""
        self.delete(key)
        if not self.enabled or size > self.max_bytes:
            return False
        ttl = self.ttl_s if ttl_s is None else ttl_s
        expires_at = self.clock() + ttl if ttl else None
        self._entries[key] = _Entry(value, size, expires_at)
        if expires_at is not None:
            heapq.heappush(self._expiry, (expires_at, key))
        self.bytes += size
        self._evict()
        return key in self._entries

    def get(self, key: str) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at is not None and self.clock() >= entry.expires_at:
            self.delete(key)
            return None
        self._entries.move_to_end(key)
        return entry.value

    def delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def resize(self, key: str, value: V, size: int) -> None:
        """Replace a value in place (a conversation growing by a turn)."""
        entry = self._entries.get(key)
        if entry is None:
            self.put(key, value, size)
            return
        self.bytes += size - entry.size
        entry.value, entry.size = value, size
        self._entries.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, key = heapq.heappop(self._expiry)
            entry = self._entries.get(key)
            if entry is not None and entry.expires_at == expires_at:
                self.delete(key)
        if len(self._expiry) > 2 * len(self._entries) + 1024:
            self._expiry = [(e.expires_at, k) for k, e in self._entries.items() if e.expires_at is not None]
            heapq.heapify(self._expiry)
        while self._entries and (len(self._entries) > self.max_entries or self.bytes > self.max_bytes):
            key = next(iter(self._entries))
            self.delete(key)
