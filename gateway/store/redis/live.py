"""Foreground responses in flight, registered in Redis so that a cancel or a GET landing on
another replica reaches them.

Each is ``NS:live:<id>`` (its replica, organization, store flag and opening snapshot) with an
expiry its replica renews every L/4 (L the job lease), so the entry of a replica that died goes
away by itself. A GET from another replica sees the opening snapshot (``in_progress``, no partial
output, as a background poll); a cancel is sent to the replica running it, which cancels the
worker request and answers with the cancelled response.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ...http.errors import ApiError
from ...lifecycle.tasks import stop_tasks
from ..protocols import StoreUnavailable
from .cancel import CancelChannel
from .codec import dumps, loads
from .connection import BACKEND_ERRORS, RedisContext, guarded
from .jobs import CANCEL_WAIT_S

log = logging.getLogger("kiln.gateway.store")


class RedisLiveRegistry:
    def __init__(self, ctx: RedisContext, cancels: CancelChannel, *, lease_s: float) -> None:
        self.ctx = ctx
        self.cancels = cancels
        self.valid_ms = max(1, int(lease_s * 750))
        self.renew_every_s = lease_s / 4
        self.here: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def add(self, response_id: str, owner: Any, snapshot: dict[str, Any], *, required: bool) -> None:
        value = dumps({"replica": self.ctx.replica, "owner": owner, "snapshot": snapshot})
        try:
            await self.ctx.redis.set(self.ctx.keys.live(response_id), value, px=self.valid_ms)
        except BACKEND_ERRORS as exc:
            if required:
                raise StoreUnavailable() from None
            log.warning("response not registered for cancel from other replicas: redis unavailable", extra={"response_id": response_id, "error": str(exc)})
            return
        self.here.add(response_id)

    async def discard(self, response_id: str) -> None:
        if response_id not in self.here:
            return
        self.here.discard(response_id)
        try:
            await self.ctx.redis.delete(self.ctx.keys.live(response_id))
        except BACKEND_ERRORS as exc:  # it expires on its own within the lease
            log.warning("live entry left to expire: redis unavailable", extra={"response_id": response_id, "error": str(exc)})

    async def _entry(self, response_id: str) -> dict[str, Any] | None:
        entry: dict[str, Any] | None = loads(await self.ctx.redis.get(self.ctx.keys.live(response_id)))
        if entry is None or entry.get("replica") == self.ctx.replica:
            return None
        return entry

    @guarded
    async def get(self, response_id: str) -> tuple[Any, dict[str, Any]] | None:
        entry = await self._entry(response_id)
        return None if entry is None else (entry.get("owner"), entry["snapshot"])

    @guarded
    async def cancel_elsewhere(self, response_id: str) -> dict[str, Any] | None:
        entry = await self._entry(response_id)
        if entry is None:
            return None
        answer = await self.cancels.request(entry["replica"], response_id, CANCEL_WAIT_S)
        if answer is None:
            raise ApiError(503, "The gateway replica running this response did not answer the cancel; retry.", headers={"Retry-After": "2"})
        return answer or None

    async def open(self) -> None:
        self._task = asyncio.create_task(self._renew_loop(), name=f"kiln-live-renew-{self.ctx.replica}")

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_tasks([task])

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.renew_every_s)
            ids = list(self.here)
            if not ids:
                continue
            try:
                pipe = self.ctx.redis.pipeline(transaction=False)
                for rid in ids:
                    pipe.pexpire(self.ctx.keys.live(rid), self.valid_ms)
                await pipe.execute()
            except BACKEND_ERRORS as exc:
                log.warning("live entries not renewed: redis unavailable", extra={"responses": len(ids), "error": str(exc)})
