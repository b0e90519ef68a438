"""Streamed retrieval from any replica: each response's numbered events in a Redis stream.

The stream of response ``R`` is ``NS:ev:R``; an event's entry id is ``<sequence_number>-1``, so
``starting_after=N`` is an XRANGE from ``N+1`` and following is an XREAD after the last id seen.
Streams are capped as the memory buffers are: ``max_events`` (``XADD MAXLEN``) within ``max_bytes``
(the recorder trims the oldest, ``XTRIM MINID``); a finished stream stays readable for the response
TTL while it is among the ``max_finished`` most recent ones and they weigh ``max_total_bytes`` in
all (each one's weight is kept beside the finished set, the oldest is dropped first).

The replica running the response records events without waiting: ``record``/``keep`` queue them
(bounded) and one writer task per response sends each batch in one pipeline, so a slow Redis never
slows a stream. A reader follows until the terminal event, or gives up after ``idle_s`` without a
new event (the owner died mid-stream; a background job's is then appended by the replica that
fails it) or when the stream is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from ...lifecycle.tasks import stop_tasks
from ..events import DEFAULT_MAX_BYTES, DEFAULT_MAX_EVENTS, DEFAULT_MAX_FINISHED, DEFAULT_MAX_TOTAL_BYTES, TERMINAL_EVENTS, TooOld
from ..protocols import StoreUnavailable
from . import scripts
from .codec import dumps, loads
from .connection import BACKEND_ERRORS, BLOCK_S, SOCKET_TIMEOUT_S, RedisContext, guarded

log = logging.getLogger("kiln.gateway.store")

FLUSH_TIMEOUT_S = 2 * SOCKET_TIMEOUT_S
_TERMINAL = frozenset(t.encode() for t in TERMINAL_EVENTS)


def _seq(entry_id: Any) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(text.split("-", 1)[0])


class RedisRecorder:
    """The events of one response this replica runs, on their way to its stream."""

    def __init__(self, log_: RedisEventLog, response_id: str) -> None:
        self._log = log_
        self.key = log_.ctx.keys.events(response_id)
        self._next = 0
        self.done = False
        self._pending: deque[dict[str, Any]] = deque(maxlen=log_.max_events)
        self._kept: deque[tuple[int, int]] = deque()  # (sequence number, bytes) of what the stream holds
        self.nbytes = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def record(self, event: dict[str, Any]) -> dict[str, Any]:
        stamped = {**event, "sequence_number": self._next}
        self._push(stamped)
        return stamped

    def keep(self, stamped: dict[str, Any]) -> None:
        if not self.done:
            self._push(stamped)

    def _push(self, stamped: dict[str, Any]) -> None:
        self._next = stamped["sequence_number"] + 1
        self._pending.append(stamped)
        if stamped.get("type") in TERMINAL_EVENTS:
            self.done = True
        self._idle.clear()
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._write_loop(), name=f"kiln-events-{self.key}")

    async def _write_loop(self) -> None:
        backoff = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = list(self._pending)
                try:
                    await self._write(batch)
                except BACKEND_ERRORS as exc:
                    log.warning("events not written yet: redis unavailable", extra={"stream": self.key, "error": str(exc)})
                    await asyncio.sleep(backoff)
                    backoff = min(2.0, backoff * 2)
                    continue
                backoff = 0.05
                last = batch[-1]["sequence_number"]
                while self._pending and self._pending[0]["sequence_number"] <= last:
                    self._pending.popleft()
            self._idle.set()

    async def _write(self, batch: list[dict[str, Any]]) -> None:
        pipe = self._log.ctx.redis.pipeline(transaction=False)
        sizes = []
        for event in batch:
            data = dumps(event)
            sizes.append((event["sequence_number"], len(data)))
            pipe.xadd(self.key, {"e": data, "t": event.get("type", "")}, id=f"{event['sequence_number']}-1", maxlen=self._log.max_events, approximate=False)
        pipe.pexpire(self.key, self._log.live_ttl_ms)
        # An id at or below the last one kept is refused: the job was taken over (its stream
        # already ends with the terminal event the replica that took it appended). Not an error.
        await pipe.execute(raise_on_error=False)
        await self._trim(sizes)

    async def _trim(self, written: list[tuple[int, int]]) -> None:
        """Drop the oldest entries beyond the byte bound (MAXLEN already kept the count)."""
        self._kept.extend(written)
        self.nbytes += sum(size for _, size in written)
        trimmed = False
        while len(self._kept) > 1 and (len(self._kept) > self._log.max_events or self.nbytes > self._log.max_bytes):
            self.nbytes -= self._kept.popleft()[1]
            trimmed = True
        if trimmed:
            await self._log.ctx.redis.xtrim(self.key, minid=f"{self._kept[0][0]}-0", approximate=False)

    async def flush(self) -> bool:
        """Wait (bounded) until every event recorded so far is in Redis."""
        try:
            await asyncio.wait_for(self._idle.wait(), FLUSH_TIMEOUT_S)
            return True
        except asyncio.TimeoutError:
            return False

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_tasks([task])


class RedisEventReader:
    def __init__(self, log_: RedisEventLog, response_id: str) -> None:
        self._log = log_
        self.key = log_.ctx.keys.events(response_id)

    async def follow(self, starting_after: int | None) -> AsyncIterator[dict[str, Any]]:
        ctx = self._log.ctx
        entries: Any
        after = -1 if starting_after is None else starting_after
        try:
            first: Any = await ctx.redis.xrange(self.key, "-", "+", count=1)
        except BACKEND_ERRORS:
            raise StoreUnavailable() from None
        oldest = _seq(first[0][0]) if first else 0
        if after + 1 < oldest:
            raise TooOld(oldest)
        idle_until = time.monotonic() + self._log.idle_s
        while True:
            try:
                entries = await ctx.redis.xrange(self.key, f"{after + 1}-0", "+", count=256)
                if not entries:
                    if not await ctx.redis.exists(self.key):
                        return  # expired or dropped: nothing more will come
                    got: Any = await ctx.blocking.xread({self.key: f"{after}-1" if after >= 0 else "0-0"}, count=256, block=int(BLOCK_S * 1000))
                    entries = got[0][1] if got else []
            except BACKEND_ERRORS as exc:
                log.warning("streamed retrieval cut: redis unavailable", extra={"stream": self.key, "error": str(exc)})
                return
            if not entries:
                if time.monotonic() > idle_until:
                    return
                continue
            idle_until = time.monotonic() + self._log.idle_s
            for _, fields in entries:
                event = loads(fields[b"e"])
                yield event
                after = event["sequence_number"]
                if fields.get(b"t") in _TERMINAL:
                    return


class RedisEventLog:
    def __init__(
        self,
        ctx: RedisContext,
        *,
        finished_ttl_s: float,
        idle_s: float,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_finished: int = DEFAULT_MAX_FINISHED,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    ) -> None:
        self.ctx = ctx
        self.max_events = max_events
        self.max_finished = max_finished
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes
        self.finished_ttl_ms = int(finished_ttl_s * 1000)
        self.idle_s = idle_s
        # A live stream outlives the longest silence of a running response by far.
        self.live_ttl_ms = int((idle_s + 600) * 1000)
        self._recorders: dict[str, RedisRecorder] = {}
        self._owners: dict[str, str] = {}  # response id -> its owner ('' for none), while recording

    def open(self, response_id: str, owner: Any = None) -> RedisRecorder:
        recorder = self._recorders[response_id] = RedisRecorder(self, response_id)
        self._owners[response_id] = "" if owner is None else str(owner)
        return recorder

    async def finish(self, response_id: str, terminal: dict[str, Any] | None = None) -> None:
        recorder = self._recorders.pop(response_id, None)
        if recorder is None:
            return
        if terminal is not None and not recorder.done:
            recorder.record(terminal)
        await recorder.flush()
        await recorder.stop()
        await self._finished(response_id, recorder.nbytes, self._owners.pop(response_id, ""))

    async def discard(self, response_id: str) -> None:
        """Stop recording without a terminal event (the job was taken over elsewhere)."""
        recorder = self._recorders.pop(response_id, None)
        self._owners.pop(response_id, None)
        if recorder is not None:
            await recorder.stop()

    async def append_terminal(self, response_id: str, event: dict[str, Any]) -> None:
        """End the stream of a response this replica did not run (its replica died, or did not
        answer a cancel): ``event`` numbered after the last one kept."""
        try:
            await self.ctx.run(scripts.EVENTS_APPEND_TERMINAL, self.ctx.keys.events(response_id), dumps(event), event["type"], self.max_events)
        except BACKEND_ERRORS as exc:
            log.warning("terminal event not appended: redis unavailable", extra={"response_id": response_id, "error": str(exc)})
            return
        await self._finished(response_id)

    async def _finished(self, response_id: str, nbytes: int = -1, owner: str = "") -> None:
        """Keep the finished stream within the bounds (``owner``'s within its share); ``nbytes``
        -1: weighed in Redis (a stream another replica wrote, whose owner it does not know)."""
        try:
            await self.ctx.run(
                scripts.EVENTS_FINISH, self.ctx.keys.events(""), response_id, self.ctx.keys.finished_events,
                self.finished_ttl_ms, self.max_finished, nbytes, self.max_total_bytes, owner,
            )
        except BACKEND_ERRORS as exc:
            log.warning("finished stream not marked: redis unavailable", extra={"response_id": response_id, "error": str(exc)})

    @guarded
    async def reader(self, response_id: str) -> RedisEventReader | None:
        if not await self.ctx.redis.exists(self.ctx.keys.events(response_id)):
            return None
        return RedisEventReader(self, response_id)

    async def close(self) -> None:
        recorders, self._recorders = list(self._recorders.values()), {}
        for recorder in recorders:
            await recorder.flush()
            await recorder.stop()
