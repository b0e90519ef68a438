"""The reasoning echo store (spec: Streaming Events).

Clients often replay an assistant turn without the ``reasoning`` item that preceded it. The turn
then renders differently from how it was generated and the worker's prefix cache misses. The
gateway remembers the reasoning item of each plain reply (keyed by the owner and the message's id
and text) and puts it back in front of the replayed message.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from .lru import approx_bytes


def _text_key(item: dict) -> str | None:
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    else:
        return None
    return "t:" + hashlib.sha256(text.encode()).hexdigest()


class ReasoningEchoStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[dict, int]] = OrderedDict()

    def remember(self, output: list[dict], owner: Any = None) -> None:
        """Keep the reasoning of a plain reply: [reasoning, message] with no tool calls."""
        if self.max_bytes <= 0 or len(output) != 2:
            return
        reasoning, message = output
        if reasoning.get("type") != "reasoning" or message.get("type") != "message":
            return
        size = approx_bytes(reasoning)
        for key in filter(None, (message.get("id"), _text_key(message))):
            self._put(f"{owner}|{key}", reasoning, size)

    def _put(self, key: str, item: dict, size: int) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (item, size)
        self.bytes += size
        while self.bytes > self.max_bytes and self._items:
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped

    def _lookup(self, item: dict, owner: Any) -> dict | None:
        for key in filter(None, (item.get("id"), _text_key(item))):
            hit = self._items.get(f"{owner}|{key}")
            if hit is not None:
                return hit[0]
        return None

    def restore(self, items: list[dict], owner: Any = None) -> list[dict]:
        """``items`` with remembered reasoning re-inserted before assistant messages lacking it."""
        if not self._items:
            return items
        out: list[dict] = []
        for item in items:
            if item.get("type") == "message" and item.get("role") == "assistant":
                previous = out[-1] if out else None
                if previous is None or previous.get("type") != "reasoning":
                    reasoning = self._lookup(item, owner)
                    if reasoning is not None:
                        out.append(reasoning)
            out.append(item)
        return out
