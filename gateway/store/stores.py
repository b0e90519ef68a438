"""``Stores``: the stores of one gateway as the rest of it sees them, whichever backend built
them (backend.py for this process, redis/backend.py for Redis). Its own module so that neither
backend imports the other."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .protocols import ConversationStore, EventLog, ItemIndex, JobBoard, LiveRegistry, ReasoningEcho, ResponseStore

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
