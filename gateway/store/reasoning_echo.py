"""The reasoning echo store (spec: Streaming Events).

Clients often replay an assistant turn without the ``reasoning`` item that preceded it. The turn
then renders differently from how it was generated and the worker's prefix cache misses. The
gateway remembers the reasoning item of each plain reply (keyed by the owner and the message's id
and text) and puts it back in front of the replayed message.

What to remember and where to put it back is decided here (``echo_entries``, ``wanted_keys``,
``reinsert``) for every backend; ``MemoryReasoningEcho`` keeps the entries in this process, a
byte-bounded LRU, and ``redis/reasoning_echo.py`` in Redis.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from .lru import approx_bytes


def _text_key(item: dict[str, Any]) -> str | None:
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    else:
        return None
    return "t:" + hashlib.sha256(text.encode()).hexdigest()


def _keys(item: dict[str, Any], owner: Any) -> list[str]:
    return [f"{owner}|{key}" for key in filter(None, (item.get("id"), _text_key(item)))]


def echo_entries(output: list[dict[str, Any]], owner: Any = None) -> tuple[list[str], dict[str, Any]] | None:
    """(keys, reasoning item) to remember for a plain reply -- [reasoning, message] with no tool
    calls -- or None when there is nothing to remember."""
    if len(output) != 2:
        return None
    reasoning, message = output
    if reasoning.get("type") != "reasoning" or message.get("type") != "message":
        return None
    return _keys(message, owner), reasoning


def _needs_echo(out: list[dict[str, Any]], item: dict[str, Any]) -> bool:
    if item.get("type") != "message" or item.get("role") != "assistant":
        return False
    previous = out[-1] if out else None
    return previous is None or previous.get("type") != "reasoning"


def wanted_keys(items: list[dict[str, Any]], owner: Any = None) -> list[str]:
    """Every key ``reinsert`` may look up for ``items`` (to fetch them in one round trip)."""
    keys: list[str] = []
    for i, item in enumerate(items):
        if _needs_echo(items[:i][-1:], item):
            keys += _keys(item, owner)
    return keys


def reinsert(items: list[dict[str, Any]], found: dict[str, dict[str, Any]], owner: Any = None) -> list[dict[str, Any]]:
    """``items`` with the reasoning in ``found`` (key -> item) put back before assistant
    messages lacking it."""
    if not found:
        return items
    out: list[dict[str, Any]] = []
    for item in items:
        if _needs_echo(out, item):
            reasoning = next((found[k] for k in _keys(item, owner) if k in found), None)
            if reasoning is not None:
                out.append(reasoning)
        out.append(item)
    return out


class MemoryReasoningEcho:
    """The ReasoningEcho of one process: the last ``max_bytes`` of reasoning, oldest out first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()

    async def remember(self, output: list[dict[str, Any]], owner: Any = None) -> None:
        entry = echo_entries(output, owner) if self.max_bytes > 0 else None
        if entry is None:
            return
        keys, reasoning = entry
        size = approx_bytes(reasoning)
        for key in keys:
            self._put(key, reasoning, size)

    def _put(self, key: str, item: dict[str, Any], size: int) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (item, size)
        self.bytes += size
        while self.bytes > self.max_bytes and self._items:
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped

    async def restore(self, items: list[dict[str, Any]], owner: Any = None) -> list[dict[str, Any]]:
        """``items`` with remembered reasoning re-inserted before assistant messages lacking it."""
        if not self._items:
            return items
        found = {k: self._items[k][0] for k in wanted_keys(items, owner) if k in self._items}
        return reinsert(items, found, owner)
