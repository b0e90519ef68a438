"""One serving loop for every door that generates: a door supplies its ``Framer`` (what its
client sees of a run) and ``frames`` (streaming) or ``drain`` (one body) runs the run through it,
the same way for all of them:

opening frames → each run event fed to the framer → at a stop sequence the generation cancelled →
the run finished (stored, billed) → the closing frames, or the error frames of a failed generation;
``frames``' ``finally`` finishes the run as cut when the client left first.

Stop sequences (``stop.py``) end an answer one way in every door: the generation is cancelled (the
worker is told to stop; what it had already sent is still read, and ignored by the framer) and,
once its events end, the response is settled as completed with the usage of what was generated:
what the client is shown and what is billed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from typing import Any, Generic, Protocol, TypeVar

from ..lifecycle.generation import GenerationFailed, RunEvent, complete_usage, terminal_event
from ..lifecycle.run import ResponseRun

F = TypeVar("F")


class Framer(Protocol[F]):
    """What a door supplies to serve a run: its frames (``F``: bytes for an SSE door, events for
    the WebSocket) and its non-streaming body."""

    @property
    def stopped(self) -> bool:
        """True once a stop sequence ended the answer: the rest of the generation is cancelled."""

    def opening_frames(self, run: ResponseRun) -> list[F]:
        """The frames before the first event."""

    def feed(self, event: RunEvent) -> list[dict[str, Any]]:
        """The door's payloads for one run event; called for every event, streamed or not, so the
        door keeps its view of the answer for ``closing_frames`` and ``answer``."""

    def frame(self, payload: dict[str, Any]) -> F:
        """One payload of ``feed`` as it is sent."""

    def closing_frames(self, run: ResponseRun) -> list[F]:
        """The last frames, once the run is finished (stored and billed)."""

    def error_frames(self, run: ResponseRun, failure: GenerationFailed) -> list[F]:
        """The last frames of a run whose generation failed mid-stream (finished too)."""

    def answer(self, run: ResponseRun, cost: Decimal | None) -> dict[str, Any]:
        """The non-streaming body of the finished run; ``cost``: the USD debited (hosted mode)."""


async def _fed(run: ResponseRun, framer: Framer[Any], events: AsyncIterator[RunEvent]) -> AsyncIterator[list[dict[str, Any]]]:
    """The framer's payloads, event by event, with the stop-sequence rule of the module docstring."""
    async for event in events:
        yield framer.feed(event)
        if framer.stopped and not run.generation.cancelled:
            run.generation.cancel()
    if framer.stopped and run.response.status == "cancelled":
        run.response.finish("completed", complete_usage(run.generation.delivered_usage))


async def frames(run: ResponseRun, framer: Framer[F], events: AsyncIterator[RunEvent] | None = None) -> AsyncIterator[F]:
    """A started run as ``framer``'s frames; ``events``: the run's (``run.events()``), when the
    door has read some of them already. If the client goes away the door's transport cancels or
    drops this generator; its ``finally`` then finishes the run as cut (the worker is told to stop,
    the delivered part is billed)."""
    try:
        for frame in framer.opening_frames(run):
            yield frame
        failure: GenerationFailed | None = None
        try:
            async for payloads in _fed(run, framer, run.events() if events is None else events):
                for payload in payloads:
                    yield framer.frame(payload)
        except GenerationFailed as exc:
            failure = exc
        await run.finish()  # before the last frames leave: a client that saw the end is billed
        for frame in framer.closing_frames(run) if failure is None else framer.error_frames(run, failure):
            yield frame
    finally:
        await run.finish(client_gone=True)  # a no-op when the run finished above


async def drain(run: ResponseRun, framer: Framer[Any]) -> None:
    """A run's events through ``framer`` without sending any (a non-streaming answer); raises
    GenerationFailed for a failed run."""
    async for _ in _fed(run, framer, run.events()):
        pass


def with_cost(payload: dict[str, Any], cost: Decimal | None) -> dict[str, Any]:
    """A non-streaming body with the hosted contract's ``usage.cost`` (USD) when one was debited."""
    if cost is None or not isinstance(payload.get("usage"), dict):
        return payload
    return {**payload, "usage": {**payload["usage"], "cost": float(cost)}}


class ResponseFramer(Generic[F]):
    """The Responses stream itself, for the SSE and WebSocket doors alike: ``response.created`` and
    ``response.in_progress`` carrying ``snapshot`` (the response as it stood before any compaction
    work), the run's events, and the terminal event once the run is finished, also after a failure
    (the response says it failed). ``numbering`` makes ``frame`` (each door numbers and frames the
    events its way) when the stream opens; ``finished`` runs between the finish and the terminal
    event."""

    stopped = False

    def __init__(self, snapshot: dict[str, Any], numbering: Callable[[], Callable[[dict[str, Any]], F]], finished: Callable[[], None] | None = None) -> None:
        self.snapshot = snapshot
        self.numbering = numbering
        self.frame: Callable[[dict[str, Any]], F]
        self.finished = finished

    def opening_frames(self, run: ResponseRun) -> list[F]:
        self.frame = self.numbering()
        return [self.frame({"type": kind, "response": self.snapshot}) for kind in ("response.created", "response.in_progress")]

    def feed(self, event: RunEvent) -> list[dict[str, Any]]:
        return [{**event}]  # the event as a plain map (numbering copies it again; bytes unchanged)

    def closing_frames(self, run: ResponseRun) -> list[F]:
        if self.finished is not None:
            self.finished()
        return [self.frame(terminal_event(run.response))]

    def error_frames(self, run: ResponseRun, failure: GenerationFailed) -> list[F]:
        return self.closing_frames(run)

    def answer(self, run: ResponseRun, cost: Decimal | None) -> dict[str, Any]:
        return with_cost(run.response.snapshot(), cost)
