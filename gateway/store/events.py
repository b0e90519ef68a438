"""Per-response event buffers for streamed retrieval (``GET /v1/responses/{id}?stream=true``).

A background job's stream events are recorded here with the sequence numbers a live stream would
have given them (gateway/http/sse.py numbers them the same way), so a client can replay them after any
``starting_after`` and then follow the live ones until the terminal event. Each buffer keeps the
last ``max_events`` events within ``max_bytes`` of JSON (older ones are dropped; a
``starting_after`` before the oldest kept is refused), and finished buffers stay readable for the
``max_finished`` most recent responses while they hold ``max_total_bytes`` in all (the oldest is
evicted first, and then reads as an expired stream). Bytes, not only counts: one event with
``top_logprobs`` or a terminal event's whole response can weigh kilobytes to megabytes. A buffer
opened for an owner (an organization) counts against its share (``OWNER_SHARE``) of both caps: its
own oldest go first, and when the whole is full the owner holding the most bytes loses first, so
one organization's streams never push another's out.

``EventBuffers`` is the EventLog of one process; ``redis/events.py`` keeps the same numbered
events in Redis streams, so that any replica can replay and follow them.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from typing import Any

from .lru import OWNER_SHARE

DEFAULT_MAX_EVENTS = 4096
DEFAULT_MAX_FINISHED = 256
DEFAULT_MAX_BYTES = 8 * 1024 * 1024  # one buffer's events, as JSON
DEFAULT_MAX_TOTAL_BYTES = 64 * 1024 * 1024  # all finished buffers together
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class TooOld(Exception):
    """``starting_after`` names an event the buffer no longer holds."""

    def __init__(self, oldest: int) -> None:
        super().__init__(oldest)
        self.oldest = oldest


def event_bytes(event: dict[str, Any]) -> int:
    """What an event weighs: the length of its JSON, as a replay sends it."""
    return len(json.dumps(event, separators=(",", ":"), ensure_ascii=False))


class EventBuffer:
    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._events: deque[dict[str, Any]] = deque()
        self._sizes: deque[int] = deque()
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._next = 0
        self.done = False
        self._changed = asyncio.Event()
        self.owner: Any = None

    def _append(self, stamped: dict[str, Any]) -> None:
        """Keep one numbered event, dropping the oldest beyond the count or the byte bound (the
        newest is always kept, so a follower still sees the end), and wake the followers."""
        size = event_bytes(stamped)
        self._events.append(stamped)
        self._sizes.append(size)
        self.nbytes += size
        while len(self._events) > 1 and (len(self._events) > self.max_events or self.nbytes > self.max_bytes):
            self._events.popleft()
            self.nbytes -= self._sizes.popleft()
        if stamped.get("type") in TERMINAL_EVENTS:
            self.done = True
        self._changed.set()
        self._changed = asyncio.Event()

    def record(self, event: dict[str, Any]) -> dict[str, Any]:
        stamped = {**event, "sequence_number": self._next}
        self._next += 1
        self._append(stamped)
        return stamped

    def keep(self, stamped: dict[str, Any]) -> None:
        """Keep an event numbered elsewhere (a live foreground stream's own sequencer); ignored
        once the buffer has ended."""
        if self.done:
            return
        self._next = stamped["sequence_number"] + 1
        self._append(stamped)

    async def flush(self) -> bool:
        return True  # kept in memory: readable at once

    def close(self) -> None:
        """No more events will come (the job ended without a terminal event being recorded)."""
        self.done = True
        self._changed.set()

    async def follow(self, starting_after: int | None) -> AsyncIterator[dict[str, Any]]:
        """Events after ``starting_after`` (all without it), then live ones until the end.

        Raises TooOld before yielding anything when events after ``starting_after`` were dropped."""
        after = -1 if starting_after is None else starting_after
        oldest = self._events[0]["sequence_number"] if self._events else self._next
        if after + 1 < oldest:
            raise TooOld(oldest)
        while True:
            waiter = self._changed
            pending = [e for e in self._events if e["sequence_number"] > after]
            for event in pending:
                yield event
                after = event["sequence_number"]
            if self.done and not any(e["sequence_number"] > after for e in self._events):
                return
            if not pending:
                await waiter.wait()


class EventBuffers:
    """The EventLog of one process: the buffers of in-flight responses, and of the most
    recently finished ones."""

    def __init__(
        self,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_finished: int = DEFAULT_MAX_FINISHED,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    ) -> None:
        self.max_events = max_events
        self.max_finished = max_finished
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes
        self._live: dict[str, EventBuffer] = {}
        self._finished: OrderedDict[str, EventBuffer] = OrderedDict()
        self.finished_bytes = 0  # what the finished buffers hold (they no longer change)
        # owner -> [bytes], its finished buffers oldest first
        self._owners: dict[Any, tuple[list[int], OrderedDict[str, None]]] = {}

    def open(self, response_id: str, owner: Any = None) -> EventBuffer:
        buffer = EventBuffer(self.max_events, self.max_bytes)
        buffer.owner = owner
        self._live[response_id] = buffer
        return buffer

    async def finish(self, response_id: str, terminal: dict[str, Any] | None = None) -> None:
        """The response ended: record ``terminal`` unless one was, and keep it as finished."""
        buffer = self._live.pop(response_id, None)
        if buffer is None:
            return
        if terminal is not None and not buffer.done:
            buffer.record(terminal)
        buffer.close()
        self._finished[response_id] = buffer
        self.finished_bytes += buffer.nbytes
        if buffer.owner is not None:
            held, ids = self._owners.setdefault(buffer.owner, ([0], OrderedDict()))
            held[0] += buffer.nbytes
            ids[response_id] = None
            while len(ids) > 1 and (len(ids) > OWNER_SHARE * self.max_finished or held[0] > OWNER_SHARE * self.max_total_bytes):
                self._evict(next(iter(ids)))  # the owner's own oldest first
        while self._finished and (len(self._finished) > self.max_finished or self.finished_bytes > self.max_total_bytes):
            self._evict(self._victim())

    def _victim(self) -> str:
        """The finished buffer to evict when all are full: the heaviest owner's oldest, else the oldest."""
        if self._owners:
            return next(iter(max(self._owners.values(), key=lambda o: o[0][0])[1]))
        return next(iter(self._finished))

    def _evict(self, response_id: str) -> None:
        evicted = self._finished.pop(response_id, None)
        if evicted is None:
            return
        self.finished_bytes -= evicted.nbytes
        if evicted.owner in self._owners:
            held, ids = self._owners[evicted.owner]
            held[0] -= evicted.nbytes
            ids.pop(response_id, None)
            if not ids:
                del self._owners[evicted.owner]

    def get(self, response_id: str) -> EventBuffer | None:
        return self._live.get(response_id) or self._finished.get(response_id)

    async def reader(self, response_id: str) -> EventBuffer | None:
        return self.get(response_id)

    async def discard(self, response_id: str) -> None:
        self.forget(response_id)

    def forget(self, response_id: str) -> None:
        self._live.pop(response_id, None)
        self._evict(response_id)
