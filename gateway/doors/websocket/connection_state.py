"""What one WebSocket connection remembers of its own responses, so that a turn can continue
through ``previous_response_id`` without the client resending history -- also for ``store: false``.

The state lives exactly as long as the socket: nothing of a ``store: false`` turn outlives its
connection, and a reconnect starts empty (the client then resends full context, which is what
``previous_response_not_found`` tells it to do). It is bounded in entries and bytes, oldest
first out, because a connection may live for an hour of agent turns.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ...store.lru import approx_bytes

# A continuation nearly always names the last response; a few more allow a client to retry a
# turn from the one before. Bytes: a long agent session's full rendered history, times a few.
DEFAULT_MAX_ENTRIES = 8
DEFAULT_MAX_BYTES = 64 << 20


@dataclass
class Remembered:
    """One finished response of this connection, as the history a continuation renders."""

    history: list[dict[str, Any]]  # its input (history included) then its output, as input items
    size: int


class ConnectionState:
    """The last responses of one connection, by id (module doc)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Remembered] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def remember(self, response_id: str, input_items: list[dict[str, Any]], output: list[dict[str, Any]]) -> bool:
        """Keep a finished response; False when it alone is over the byte budget (not kept)."""
        history = list(input_items) + [as_input(item) for item in output if item.get("type") != "compaction"]
        size = approx_bytes(history)
        self.forget(response_id)
        if size > self.max_bytes or self.max_entries <= 0:
            return False
        self._entries[response_id] = Remembered(history, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= oldest.size
        return True

    def history(self, response_id: str) -> list[dict[str, Any]] | None:
        """The items to render before a continuation's new input, or None when unknown here."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return list(entry.history)

    def forget(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


def as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item replayed as input: without the fields only outputs carry."""
    if item.get("type") == "message":
        return {"type": "message", "role": item.get("role", "assistant"), "content": item.get("content") or [], "id": item.get("id")}
    return {k: v for k, v in item.items() if k != "status"}
