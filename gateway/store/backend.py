"""The stores of one gateway, built from its settings: in this process (``--store memory``, and
``none``, which keeps no responses) or in Redis shared by every replica (``--store redis``).

The rest of the gateway sees only the Protocols of ``protocols.py`` through ``Stores``; this is
the one place that knows which backend is in use.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .background import MemoryJobBoard
from .conversations import MemoryConversationStore
from .events import EventBuffers
from .items import MemoryItemIndex
from .live import LocalLiveRegistry
from .protocols import ConversationStore, EventLog, ItemIndex, JobBoard, LiveRegistry, ReasoningEcho, ResponseStore
from .reasoning_echo import MemoryReasoningEcho
from .responses import MemoryResponseStore

CancelHandler = Callable[[str], Awaitable[dict[str, Any] | None]]


class Lifecycle(Protocol):
    """What a backend runs beside requests (Redis: leases, the sweeper, the cancel listener)."""

    async def open(self, cancel_here: CancelHandler) -> None: ...

    async def close(self) -> None: ...


@dataclass
class Stores:
    mode: str
    responses: ResponseStore | None
    conversations: ConversationStore
    reasoning_echo: ReasoningEcho
    items: ItemIndex
    jobs: JobBoard
    events: EventLog
    live: LiveRegistry
    replica: str = "local"
    lifecycle: Lifecycle | None = None

    async def open(self, cancel_here: CancelHandler) -> None:
        """Start what the backend runs beside requests; ``cancel_here`` answers cancels sent by
        other replicas for responses this one runs."""
        if self.lifecycle is not None:
            await self.lifecycle.open(cancel_here)

    async def close(self) -> None:
        if self.lifecycle is not None:
            await self.lifecycle.close()


def build_stores(settings: Any) -> Stores:
    if settings.store_mode == "redis":
        from .redis.backend import redis_stores

        return redis_stores(settings)
    responses = None
    if settings.store_mode != "none":
        responses = MemoryResponseStore(settings.responses_store_max_entries, settings.responses_store_max_bytes, settings.responses_store_ttl_secs, settings.responses_background_ephemeral_ttl_secs)
    return Stores(
        mode=settings.store_mode,
        responses=responses,
        conversations=MemoryConversationStore(settings.conversation_store_max_entries, settings.conversation_store_max_bytes, settings.conversation_store_ttl_secs),
        reasoning_echo=MemoryReasoningEcho(settings.reasoning_echo_max_bytes),
        items=MemoryItemIndex(),
        jobs=MemoryJobBoard(settings.responses_background_max_jobs, settings.responses_store_max_bytes, responses),
        events=EventBuffers(),
        live=LocalLiveRegistry(),
    )
