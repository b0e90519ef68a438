"""The Redis stores of one replica, wired together, and what runs beside them."""

from __future__ import annotations

import os
import secrets
from typing import Any

from ..stores import CancelHandler, Stores
from .cancel import CancelChannel
from .connection import RedisContext
from .conversations import RedisConversationStore
from .events import RedisEventLog
from .items import RedisItemIndex
from .jobs import RedisJobBoard
from .live import RedisLiveRegistry
from .reasoning_echo import RedisReasoningEcho
from .responses import RedisResponseStore


class RedisLifecycle:
    """The cancel listener, the job leases and sweeper, the live entries' renewals."""

    def __init__(self, ctx: RedisContext, cancels: CancelChannel, jobs: RedisJobBoard, live: RedisLiveRegistry, events: RedisEventLog) -> None:
        self.ctx, self.cancels, self.jobs, self.live, self.events = ctx, cancels, jobs, live, events

    async def open(self, cancel_here: CancelHandler) -> None:
        await self.cancels.open(cancel_here)
        await self.jobs.open()
        await self.live.open()

    async def close(self) -> None:
        await self.live.close()
        await self.jobs.close()
        await self.cancels.close()
        await self.events.close()
        await self.ctx.close()


def redis_stores(settings: Any) -> Stores:
    if not settings.redis_url:
        raise ValueError("--store redis needs --redis-url (env KILN_REDIS_URL)")
    replica = f"{os.getpid()}-{secrets.token_hex(4)}"
    ctx = RedisContext(settings.redis_url, settings.redis_namespace, replica)
    lease = settings.responses_background_lease_secs
    responses = RedisResponseStore(ctx, settings.responses_store_max_entries, settings.responses_store_max_bytes, settings.responses_store_ttl_secs, settings.responses_background_ephemeral_ttl_secs)
    events = RedisEventLog(ctx, finished_ttl_s=settings.responses_store_ttl_secs, idle_s=settings.first_event_timeout_s + settings.event_timeout_s)
    cancels = CancelChannel(ctx)
    jobs = RedisJobBoard(ctx, responses, events, cancels, max_jobs=settings.responses_background_max_jobs, max_bytes=settings.responses_store_max_bytes, lease_s=lease)
    live = RedisLiveRegistry(ctx, cancels, lease_s=lease)
    return Stores(
        mode="redis",
        responses=responses,
        conversations=RedisConversationStore(ctx, settings.conversation_store_max_entries, settings.conversation_store_max_bytes, settings.conversation_store_ttl_secs),
        reasoning_echo=RedisReasoningEcho(ctx, settings.reasoning_echo_max_bytes),
        items=RedisItemIndex(ctx),
        jobs=jobs,
        events=events,
        live=live,
        replica=replica,
        lifecycle=RedisLifecycle(ctx, cancels, jobs, live, events),
    )
