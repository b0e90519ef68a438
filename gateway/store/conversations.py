"""Per-conversation transcripts for requests that name a ``conversation``."""

from __future__ import annotations

from typing import Any

from .lru import BoundedLRU, approx_bytes


class ConversationStore:
    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self._lru: BoundedLRU[list[dict[str, Any]]] = BoundedLRU(max_entries, max_bytes, ttl_s)

    @property
    def enabled(self) -> bool:
        return self._lru.enabled

    def transcript(self, conversation_id: str) -> list[dict[str, Any]]:
        return list(self._lru.get(conversation_id) or [])

    def append(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        transcript = (self._lru.get(conversation_id) or []) + items
        self._lru.resize(conversation_id, transcript, approx_bytes(transcript))

    def replace(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        """Swap the transcript for a compacted one."""
        self._lru.resize(conversation_id, list(items), approx_bytes(items))
