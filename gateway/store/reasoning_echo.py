"""The reasoning echo store (spec: Streaming Events).

Clients often replay an assistant turn without the ``reasoning`` item that preceded it. The turn
then renders differently from how it was generated and the worker's prefix cache misses. The
gateway remembers the reasoning item of each plain reply (keyed by the owner and the message's id
and text) and puts it back in front of the replayed message.

What to remember and where to put it back is decided here (``echo_entries``, ``wanted_keys``,
``reinsert``) for every backend; ``MemoryReasoningEcho`` keeps the entries in this process, a
byte-bounded LRU, and ``redis/reasoning_echo.py`` in Redis. In both, an owner (an organization)
keeps at most its share (``OWNER_SHARE``) of the bytes: one tenant's long reasoning evicts its
own older entries, never another's (issue 30).
"""

from __future__ import annotations

import hashlib
from typing import Any

from .lru import OWNER_SHARE, BoundedLRU, approx_bytes

# Bounded by bytes only, as the spec's flag says.
NO_ENTRY_LIMIT = 2**31 - 1


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
    """The ReasoningEcho of one process: the last ``max_bytes`` of reasoning, oldest out first,
    each owner within its share."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lru: BoundedLRU[dict[str, Any]] = BoundedLRU(NO_ENTRY_LIMIT, max_bytes, 0, owner_share=OWNER_SHARE)

    async def remember(self, output: list[dict[str, Any]], owner: Any = None) -> None:
        entry = echo_entries(output, owner) if self.max_bytes > 0 else None
        if entry is None:
            return
        keys, reasoning = entry
        size = approx_bytes(reasoning)
        for key in keys:
            self._lru.put(key, reasoning, size, owner=owner)

    async def restore(self, items: list[dict[str, Any]], owner: Any = None) -> list[dict[str, Any]]:
        """``items`` with remembered reasoning re-inserted before assistant messages lacking it."""
        if not len(self._lru):
            return items
        found = {k: v for k in wanted_keys(items, owner) if (v := self._lru.get(k)) is not None}
        return reinsert(items, found, owner)
