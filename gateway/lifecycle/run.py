"""The life of one foreground response, in one object, whatever door it came through.

``ResponseRun`` starts a prepared generation (compaction phase, a worker), hands its events to the
door that frames them (JSON, SSE, WebSocket), and on every exit -- completed, incomplete,
failed, cancelled, client gone -- does the same things once, in the same order:

1. stores the response (when ``store`` is on) and forgets it as in flight, so ``cancel`` no longer
   reaches it and its worker channel is closed (the worker is told to stop if it had not finished);
   a response the store could not keep ends ``failed`` (``refusal`` holds the 503 for a door that
   has not answered yet);
2. settles the admission ticket with what the client received: the final usage, or for a cut
   stream or a cancel the usage of the events delivered so far, plus any compaction done for it;
3. closes the ticket, which releases the organization's concurrency slot.

The doors call ``finish()`` themselves before their last bytes leave, so that a client that saw a
finished response is always in the ledger; the ``finally`` of the door calls it again (a no-op
then) with ``client_gone=True`` when the client left first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import anyio

from kiln.protocol.usage import Usage

from ..http.errors import ApiError
from .admission import Ticket
from .generation import Generation, RunEvent

if TYPE_CHECKING:
    from .service import ResponsesService


def ledger_outcome(status: str, *, client_gone: bool, delivered_output: bool) -> str:
    """The ledger status for a response that ended in ``status``.

    Completed and incomplete responses are billed as such; a response cancelled by its owner is
    billed as ``cancelled`` for what it streamed; a client that left mid-stream is billed
    ``incomplete`` for what it received; a failure, or a client that left before receiving any
    output, is recorded unbilled as ``failed``."""
    if status in ("completed", "incomplete"):
        return status
    if client_gone:
        return "incomplete" if delivered_output else "failed"
    if status == "cancelled":
        return "cancelled"
    return "failed"


class ResponseRun:
    """One foreground response between admission and its last byte."""

    def __init__(self, service: ResponsesService, generation: Generation, own_input: list[dict[str, Any]], ticket: Ticket, *, streaming: bool) -> None:
        self.service = service
        self.generation = generation
        self.own_input = own_input
        self.ticket = ticket
        self.streaming = streaming
        self._finished = False
        self._cost: Decimal | None = None
        # Set when the finished response could not be stored (the store is down): a door that has
        # not answered yet answers with it (a streamed response ends with ``response.failed``).
        self.refusal: ApiError | None = None

    @property
    def response(self) -> Any:
        return self.generation.response

    async def start(self) -> None:
        """Compaction phase, then a worker; raises ApiError when the response cannot start.

        First the ticket's reservation is extended to the input as expanded (402 otherwise)."""
        generation = self.generation
        await self.ticket.cover(generation.request, self.service.pool.context_window(generation.model) or 0)
        await self.service.start_foreground(self.generation)

    def events(self) -> AsyncIterator[RunEvent]:
        """The response's events without sequence numbers (raises GenerationFailed at the end of a
        failed one, after the response was marked failed)."""
        return self.generation.events()

    def billable_usage(self, *, client_gone: bool) -> Usage:
        """What the client received: the final usage, else the running usage of the last event
        delivered; plus the usage of compaction done for this response."""
        generation = self.generation
        final = self.response.data.get("usage")
        received = Usage()
        if final and not client_gone and self.response.status in ("completed", "incomplete"):
            received = Usage.from_map(final)
        elif self.streaming or not client_gone:  # a non-streaming client that left received nothing
            received = generation.delivered_usage or Usage()
        return received + (generation.compaction_usage or Usage())

    async def finish(self, *, client_gone: bool = False) -> Decimal | None:
        """Store, forget, settle and release, once; the USD debited (hosted mode) or None."""
        if self._finished:
            return self._cost
        self._finished = True
        with anyio.CancelScope(shield=True):
            generation, response = self.generation, self.response
            try:
                if client_gone and response.status not in ("completed", "incomplete", "failed", "cancelled"):
                    response.cancel()
                    generation.close()
                self.refusal = await self.service.finish_foreground(generation, self.own_input)
                generation.close()
                usage = self.billable_usage(client_gone=client_gone)
                # A compaction_trigger turn delivered its compaction item, with no output tokens.
                delivered = usage.output_tokens > 0 or generation.done_without_worker
                outcome = ledger_outcome(response.status, client_gone=client_gone, delivered_output=delivered)
                if outcome == "failed" and not self.streaming and not client_gone:
                    outcome = "error"  # the client got an HTTP error, not a response
                self._cost = await self.ticket.settle(outcome, usage)
            finally:
                await self.ticket.close()
        return self._cost
