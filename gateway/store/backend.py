"""The stores of one gateway, built from its settings: in this process (``--store memory``, and
``none``, which keeps no responses) or in Redis shared by every replica (``--store redis``).

The rest of the gateway sees only the Protocols of ``protocols.py`` through ``Stores``; this is
the one place that knows which backend is in use.
"""

from __future__ import annotations

from typing import Any

from .background import MemoryJobBoard
from .conversations import MemoryConversationStore
from .events import EventBuffers
from .items import MemoryItemIndex
from .live import LocalLiveRegistry
from .reasoning_echo import MemoryReasoningEcho
from .responses import MemoryResponseStore
from .stores import Stores


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
