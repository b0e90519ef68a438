"""Where each stored item lives, so that an ``item_reference`` resolves without scanning stores.

The index maps (owner, item id) to the stored response or conversation that holds the item; the
holder is always re-read, so an entry left behind by an evicted or deleted holder resolves to
nothing. The index is bounded by entries (oldest forgotten first): it can only ever forget a
reference that its holder's own LRU would likely have dropped already.

``MemoryItemIndex`` is the one of one process; ``redis/items.py`` the shared one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

DEFAULT_MAX_ENTRIES = 262144


class MemoryItemIndex:
    """The ItemIndex of one process."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._where: OrderedDict[tuple[Any, str], tuple[str, str]] = OrderedDict()

    async def add(self, owner: Any, items: list[dict[str, Any]], holder: tuple[str, str]) -> None:
        """``holder`` is ("response", response id) or ("conversation", store key)."""
        for item in items:
            item_id = item.get("id")
            if isinstance(item_id, str) and item_id:
                key = (owner, item_id)
                self._where.pop(key, None)
                self._where[key] = holder
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)

    async def lookup(self, owner: Any, item_id: str) -> tuple[str, str] | None:
        return self._where.get((owner, item_id))

    def __len__(self) -> int:
        return len(self._where)
