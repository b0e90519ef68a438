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

# The most of a store (entries and bytes) one organization may fill: beyond it its own oldest
# entries go, and when the store as a whole is full the organization holding the most loses
# first. One value for every store with tenants, in memory and in Redis (redis/scripts.py).
OWNER_SHARE = 0.25


def approx_bytes(value: Any) -> int:
    """Serialized JSON size: what a value costs to keep, near enough for a budget."""
    return len(json.dumps(value, separators=(",", ":"), default=str))


@dataclass
class _Entry(Generic[V]):
    value: V
    size: int
    expires_at: float | None
    owner: Any = None


class BoundedLRU(Generic[V]):
    """``max_entries`` 0 means nothing is kept; ``max_bytes`` 0 means an entry is evicted as
    soon as it is put; ``ttl_s`` 0 means entries never expire.

    Entries may have a tenant: given to ``put`` (``owner``), or else ``owner_of(key)`` (None for
    none). With ``owner_share``, one tenant keeps at most that share of the entries and bytes
    (its own oldest go first), and when the store as a whole is full the tenant holding the most
    bytes loses its oldest entry: a tenant filling the store evicts its own entries, never a
    smaller tenant's."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float, *, clock: Callable[[], float] = time.monotonic, owner_of: Callable[[str], Any] | None = None, owner_share: float = 1.0) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.owner_of = owner_of
        self.owner_share = owner_share
        # tenant -> [bytes, its keys oldest first] (only with owner_of)
        self._owners: dict[Any, tuple[list[int], OrderedDict[str, None]]] = {}
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

    def put(self, key: str, value: V, size: int, *, ttl_s: float | None = None, owner: Any = None) -> bool:
        """Keep ``value``; False when it could not be kept (store off, or larger than the budget
        or than its tenant's share of it)."""
        self.delete(key)
        if not self.enabled or size > self.max_bytes:
            return False
        ttl = self.ttl_s if ttl_s is None else ttl_s
        expires_at = self.clock() + ttl if ttl else None
        if owner is None and self.owner_of is not None:
            owner = self.owner_of(key)
        self._entries[key] = _Entry(value, size, expires_at, owner)
        if expires_at is not None:
            heapq.heappush(self._expiry, (expires_at, key))
        self.bytes += size
        self._own(key, owner, size)
        self._evict(key)
        return key in self._entries

    def get(self, key: str) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at is not None and self.clock() >= entry.expires_at:
            self.delete(key)
            return None
        self._entries.move_to_end(key)
        self._touch(key)
        return entry.value

    def delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        self._own(key, entry.owner, -entry.size)
        return True

    def resize(self, key: str, value: V, size: int) -> None:
        """Replace a value in place (a conversation growing by a turn)."""
        entry = self._entries.get(key)
        if entry is None:
            self.put(key, value, size)
            return
        self.bytes += size - entry.size
        self._own(key, entry.owner, size - entry.size)
        entry.value, entry.size = value, size
        self._entries.move_to_end(key)
        self._evict(key)

    # -- tenants ---------------------------------------------------------------------------------
    def _own(self, key: str, owner: Any, delta: int) -> None:
        """Account ``delta`` bytes of ``key`` (put, resized or deleted just now) to its tenant."""
        if owner is None:
            return
        held, keys = self._owners.setdefault(owner, ([0], OrderedDict()))
        held[0] += delta
        if key in self._entries:
            keys[key] = None
            keys.move_to_end(key)
        else:
            keys.pop(key, None)
            if not keys:
                del self._owners[owner]

    def _touch(self, key: str) -> None:
        owner = self._entries[key].owner
        if owner in self._owners and key in self._owners[owner][1]:
            self._owners[owner][1].move_to_end(key)

    def _victim(self) -> str:
        """The entry to evict when the store is full: the heaviest tenant's oldest, else the oldest."""
        if self._owners:
            held, keys = max(self._owners.values(), key=lambda o: o[0][0])
            return next(iter(keys))
        return next(iter(self._entries))

    def _over_share(self, owner: Any) -> bool:
        held, keys = self._owners[owner]
        return held[0] > self.owner_share * self.max_bytes or len(keys) > self.owner_share * self.max_entries

    def _evict(self, added: str | None = None) -> None:
        """Expire, then bring ``added``'s tenant within its share, then the store within its bounds."""
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, key = heapq.heappop(self._expiry)
            entry = self._entries.get(key)
            if entry is not None and entry.expires_at == expires_at:
                self.delete(key)
        if len(self._expiry) > 2 * len(self._entries) + 1024:
            self._expiry = [(e.expires_at, k) for k, e in self._entries.items() if e.expires_at is not None]
            heapq.heapify(self._expiry)
        if added is not None and added in self._entries:
            owner = self._entries[added].owner
            while owner in self._owners and self._over_share(owner):
                self.delete(next(iter(self._owners[owner][1])))  # the tenant's own oldest first
        while self._entries and (len(self._entries) > self.max_entries or self.bytes > self.max_bytes):
            self.delete(self._victim())
