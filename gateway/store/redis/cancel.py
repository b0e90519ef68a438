"""Cancel across replicas: a request on the running replica's Redis pub/sub channel, answered
on a reply list the asker waits on (bounded).

Each replica listens on ``NS:cancel:<replica id>``. A cancel that lands on another replica
publishes ``{"id", "reply"}`` there; the owner cancels the worker request as it would its own
(``handler``) and pushes its answer to the ``reply`` list, which expires on its own. ``PUBLISH``
returns how many listened: none means the owner is gone (or cut off from Redis), and the asker
knows at once instead of waiting out the timeout. The listener reconnects by itself after Redis
comes back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...lifecycle.tasks import stop_tasks
from .codec import dumps, loads
from .connection import BACKEND_ERRORS, BLOCK_S, RedisContext

log = logging.getLogger("kiln.gateway.store")

Handler = Callable[[str], Awaitable[dict[str, Any] | None]]
REPLY_TTL_MS = 30_000


class CancelChannel:
    def __init__(self, ctx: RedisContext) -> None:
        self.ctx = ctx
        self.handler: Handler | None = None
        self._task: asyncio.Task[None] | None = None
        self._answers: set[asyncio.Task[None]] = set()
        self.listening = asyncio.Event()  # subscribed (tests wait for it instead of sleeping)

    async def open(self, handler: Handler) -> None:
        self.handler = handler
        self._task = asyncio.create_task(self._listen(), name=f"kiln-cancel-{self.ctx.replica}")

    async def close(self) -> None:
        tasks, self._task = [self._task, *self._answers], None
        await stop_tasks(tasks)

    async def request(self, replica: str, response_id: str, timeout_s: float) -> dict[str, Any] | None:
        """Ask ``replica`` to cancel ``response_id``: its answer (``{}`` when it does not run it),
        or None when no replica listened or it did not answer within ``timeout_s``."""
        reply = self.ctx.keys.reply(secrets.token_hex(8))
        listeners = await self.ctx.redis.publish(self.ctx.keys.cancel_channel(replica), dumps({"id": response_id, "reply": reply}))
        if not listeners:
            return None
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = await self.ctx.blocking.blpop([reply], timeout=max(0.01, min(BLOCK_S, left)))
            if got is not None:
                return loads(got[1]) or {}
        return None

    async def _listen(self) -> None:
        channel = self.ctx.keys.cancel_channel(self.ctx.replica)
        backoff = 0.1
        while True:
            pubsub = self.ctx.redis.pubsub()
            try:
                await pubsub.subscribe(channel)
                self.listening.set()
                backoff = 0.1
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=BLOCK_S)
                    if message is not None and message.get("type") == "message":
                        self._spawn(message["data"])
            except BACKEND_ERRORS as exc:
                self.listening.clear()
                log.warning("cancel listener reconnecting: redis unavailable", extra={"error": str(exc)})
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            finally:
                try:
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8.2 on
                except BACKEND_ERRORS:
                    pass

    def _spawn(self, data: bytes) -> None:
        try:
            request = loads(data)
            response_id, reply = str(request["id"]), str(request["reply"])
        except (ValueError, TypeError, KeyError):
            log.warning("malformed cancel request ignored")
            return
        task = asyncio.create_task(self._answer(response_id, reply))
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    async def _answer(self, response_id: str, reply: str) -> None:
        assert self.handler is not None
        try:
            answer = await self.handler(response_id)
        except Exception:
            log.exception("cancel from another replica failed")
            answer = None
        try:
            pipe = self.ctx.redis.pipeline(transaction=True)
            pipe.rpush(reply, dumps(answer or {}))
            pipe.pexpire(reply, REPLY_TTL_MS)
            await pipe.execute()
        except BACKEND_ERRORS as exc:
            log.warning("cancel answer lost: redis unavailable", extra={"error": str(exc)})
