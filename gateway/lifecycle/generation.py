"""Drive one response through a worker and turn its messages into Responses stream events."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, TypedDict

from kiln.protocol import Done, Event, Failed, Generate
from kiln.protocol.events import OUTPUT_ITEM_ADDED, OUTPUT_ITEM_DONE, OutputItemDone, WorkerEvent, is_item_done
from kiln.protocol.request import GenerateRequest
from kiln.protocol.usage import Usage

from ..doors.create_request import CreateRequest
from ..doors.options import NO_OPTIONS, DoorOptions
from ..http.errors import ApiError
from ..pool.worker_request import worker_request
from ..pool.workers import Channel, NoWorker, WorkerHandle, WorkerPool, routing_key
from .response_object import ResponseObject

# The code of a worker's refusal when its batch and queue are full (or its preparation queue).
OVERLOADED = "server_is_overloaded"


class CompactionStarted(TypedDict):
    """The gateway's own event before a compaction it runs for ``context_management``."""

    type: Literal["mlx.compaction.started"]
    response_id: str
    input_tokens: int


class CompactionCompleted(TypedDict):
    type: Literal["mlx.compaction.completed"]
    response_id: str
    input_tokens_before: int
    input_tokens_after: int


# What a generation yields: the worker's events, after the gateway's compaction events and items.
RunEvent = WorkerEvent | CompactionStarted | CompactionCompleted


def cache_scope(owner: Any) -> str | None:
    """The worker prefix cache's scope for ``owner``'s requests: one per organization in hosted
    mode (None, one shared cache, when auth is off). Derived here and never from the body, so no
    client can step into another's scope; a digest, so the worker's logs name no organization."""
    if owner is None:
        return None
    return hashlib.sha256(f"kiln cache scope {owner}".encode()).hexdigest()[:32]


class GenerationFailed(Exception):
    """The worker could not produce the response; carries what a client should see."""

    def __init__(self, http_status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.code = code
        self.message = message
        self.param = param

    def api_error(self) -> ApiError:
        # A worker's 503 (its queue or preparation full, its engine away) passes soon: say when.
        headers = {"Retry-After": "1"} if self.http_status == 503 else None
        return ApiError(self.http_status, self.message, code=self.code, param=self.param, headers=headers)


class Generation:
    """A create call in flight: one request on one worker.

    ``events()`` yields every stream event of the response (without sequence numbers) and keeps
    ``response`` up to date, so the streaming route, the non-streaming route and background jobs
    all consume the same sequence.
    """

    def __init__(
        self,
        pool: WorkerPool,
        response: ResponseObject,
        request: CreateRequest,
        model: str,
        *,
        options: DoorOptions = NO_OPTIONS,
        owner: Any = None,
        wire_input: list[dict[str, Any]] | None = None,
        compact_threshold: int | None = None,
        first_event_timeout_s: float | None = None,
        event_timeout_s: float | None = None,
        item_hook: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.pool = pool
        self.response = response
        # The client's request as it stands (compaction replaces it with the compacted history).
        self.request = request
        self.model = model
        # What the door decided (raw prompt, session, warm-up): never from the client's body.
        self.options = options
        # Who may see this response (the organization in hosted mode; None when auth is off).
        self.owner = owner
        # What the worker renders: ``request.input`` with compaction items expanded.
        self.wire_input: list[dict[str, Any]] = request.input if wire_input is None else wire_input
        # context_management's compaction threshold, when the request set one.
        self.compact_threshold = compact_threshold
        # How long the worker may take to send its first message, and then each next one, before
        # the response fails (a hung worker must never hold a client or its slots forever).
        self.first_event_timeout_s = first_event_timeout_s
        self.event_timeout_s = event_timeout_s
        # Applied to each finished output item before anyone sees it (e.g. sealing reasoning).
        self.item_hook = item_hook
        self.channel: Channel | None = None
        # What the worker is sent, built by open() from the request as it then stands.
        self.sent: GenerateRequest | None = None
        self.cancelled = False
        # Events the gateway produced before generation (compaction), and how many output
        # items they hold: the worker's output indices are shifted past them.
        self.prefix_events: list[RunEvent] = []
        self.index_offset = 0
        # Feeds TTFT / inter-token histograms when metrics are on (set when the run starts).
        self.timer: Any = None
        # True when the response is complete without a generation (a compaction_trigger turn).
        self.done_without_worker = False
        # The running usage after the last worker message (what a cut stream received), and the
        # usage of compaction the gateway ran for this response (billed with it).
        self.delivered_usage: Usage | None = None
        self.compaction_usage: Usage | None = None
        # Workers that refused this request as full (their view of capacity is current, ours lags
        # a heartbeat behind when other gateway replicas share them): it is not sent there again.
        self.refused_by: set[bytes] = set()

    async def open(self) -> None:
        """Send the request to a worker; raises ApiError(503) when none can take it."""
        if self.done_without_worker:
            return
        sent = worker_request(self.request, self.wire_input, self.options)  # a bad value: 400 before anything is sent
        sent = dataclasses.replace(sent, cache_scope=cache_scope(self.owner))
        cache_key = routing_key(self.request, self.options.session)
        try:
            worker = self.pool.pick(self.model, cache_key)
        except NoWorker:
            raise ApiError(503, f"No worker is serving model '{self.model}' right now.", code="server_is_overloaded", headers={"Retry-After": "1"}) from None
        self.sent = sent
        await self._send_to(worker)

    async def _send_to(self, worker: WorkerHandle) -> None:
        assert self.sent is not None, "open() first"
        req_id = uuid.uuid4().hex
        message = Generate(req_id=req_id, response_id=self.response.id, request=self.sent)
        self.channel = await self.pool.open(worker, req_id, message, limits=self.pool.limits(worker, self.sent.sampling.max_output_tokens))

    def add_prefix_item(self, item: dict[str, Any]) -> None:
        """An output item the gateway made (a compaction), placed before the worker's items."""
        index = self.index_offset
        self.prefix_events.append({"type": OUTPUT_ITEM_ADDED, "output_index": index, "item": item})
        done: OutputItemDone = {"type": OUTPUT_ITEM_DONE, "output_index": index, "item": item}
        self.prefix_events.append(done)
        self.response.apply(done)
        self.index_offset += 1

    def answer_without_worker(self, item: dict[str, Any], usage: Usage) -> None:
        """A ``compaction_trigger`` turn: ``item`` is the whole answer and no worker is asked."""
        self.add_prefix_item(item)
        self.done_without_worker = True
        self.response.finish("completed", complete_usage(usage))

    def compacted(self, history: list[dict[str, Any]], wire_input: list[dict[str, Any]], usage: Usage, events: list[RunEvent], item: dict[str, Any]) -> None:
        """Generate over the compacted ``history`` (``wire_input``: expanded) instead; ``events``
        and ``item`` stream first, and the compaction's ``usage`` is billed with the response."""
        self.request = self.request.with_input(history)
        self.wire_input = wire_input
        self.compaction_usage = usage
        self.prefix_events += events
        self.add_prefix_item(item)

    def close(self) -> None:
        if self.channel is not None:
            self.pool.close(self.channel, cancel=True)

    def cancel(self) -> None:
        """Stop generating; the event sequence ends with the response cancelled."""
        self.cancelled = True
        if self.channel is not None:
            self.pool.close(self.channel, cancel=True)
            self.channel.queue.put_nowait(None)

    async def events(self) -> AsyncIterator[RunEvent]:
        for event in self.prefix_events:
            yield event
        if self.done_without_worker:
            return
        assert self.channel is not None, "open() first"
        timeout = self.first_event_timeout_s
        started = False  # whether the worker has sent an event (a refusal can only come before)
        try:
            while True:
                try:
                    message = await next_message(self.channel, timeout)
                except asyncio.TimeoutError:
                    text = "The model backend did not answer in time."
                    self.response.fail("server_error", text)
                    raise GenerationFailed(504, "server_error", text) from None
                timeout = self.event_timeout_s
                if message is None or self.cancelled:
                    self.response.cancel()
                    return
                if isinstance(message, Event):
                    # One without events is progress while the worker prefills: alive, no output.
                    started = started or bool(message.events)
                    if message.usage is not None:
                        self.delivered_usage = message.usage
                    for event in message.events:
                        yield self._apply(event)
                elif isinstance(message, Done):
                    self.response.finish(message.status, complete_usage(message.usage), message.incomplete_details)
                    if self.timer is not None and self.timer.metrics is not None:
                        self.timer.metrics.observe_usage(self.response.data["usage"])
                    return
                elif isinstance(message, Failed):
                    if message.code == OVERLOADED and not started and await self._reroute():
                        timeout = self.first_event_timeout_s
                        continue
                    self.response.fail(message.code, message.message)
                    raise GenerationFailed(message.http_status, message.code, message.message, message.param)
        finally:
            self.pool.close(self.channel, cancel=not self.channel.finished)

    async def _reroute(self) -> bool:
        """After the worker refused the request as full: send it to another worker of the model
        that has room by our count, if there is one (True), else leave the refusal to the client."""
        assert self.channel is not None
        self.refused_by.add(self.channel.worker.identity)
        self.pool.close(self.channel, cancel=False)
        try:
            worker = self.pool.pick(self.model, routing_key(self.request, self.options.session), exclude=self.refused_by)
        except NoWorker:
            return False
        if worker.overloaded():
            return False
        await self._send_to(worker)
        return True

    def _apply(self, event: WorkerEvent) -> WorkerEvent:
        """One worker event, placed after any prefix items and folded into the response (a copy
        when it changes: the worker's map is left as it came)."""
        if self.timer is not None:
            self.timer.event(event)
        if self.index_offset and "output_index" in event:
            event = event.copy()
            event["output_index"] += self.index_offset
        if self.item_hook is not None and is_item_done(event):
            done = event.copy()
            done["item"] = self.item_hook(event["item"])
            event = done
        self.response.apply(event)
        return event


def complete_usage(usage: Usage | None) -> dict[str, Any]:
    """A usage (none: zeros) as the complete map the Responses schema requires."""
    return (usage or Usage()).to_map()


def terminal_event(response: ResponseObject) -> dict[str, Any]:
    kind = {
        "completed": "response.completed",
        "incomplete": "response.incomplete",
        "failed": "response.failed",
        "cancelled": "response.failed",
    }[response.status]
    return {"type": kind, "response": response.snapshot()}


async def next_message(channel: Channel, timeout_s: float | None) -> Any:
    """The channel's next message; asyncio.TimeoutError after ``timeout_s`` (None: no bound).

    Not ``asyncio.wait_for``: before Python 3.12 it can swallow the cancellation of its caller when
    the message arrives in the same instant, and a request whose client left would then run on
    to its end, holding its slot (messages arrive every few milliseconds while a worker streams)."""
    if timeout_s is None:
        return await channel.get()
    if hasattr(asyncio, "timeout"):  # 3.11+
        async with asyncio.timeout(timeout_s):
            return await channel.get()
    getter = asyncio.ensure_future(channel.get())
    try:
        done, _ = await asyncio.wait({getter}, timeout=timeout_s)
    finally:
        if not getter.done():
            getter.cancel()
    if not done:
        raise asyncio.TimeoutError
    return getter.result()


async def ask(pool: WorkerPool, model: str, cache_key: str | None, message_for: Callable[[str], Any], timeout_s: float | None) -> Any:
    """The one answer a single-answer request (count, compact) gets from a worker of ``model``,
    within ``timeout_s``; ``message_for(req_id)`` is what it is sent. A refusal is its ApiError."""
    try:
        worker = pool.pick(model, cache_key)
    except NoWorker:
        raise ApiError(503, f"No worker is serving model '{model}' right now.", code="server_is_overloaded") from None
    req_id = uuid.uuid4().hex
    channel = await pool.open(worker, req_id, message_for(req_id))
    try:
        message = await next_message(channel, timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(504, "The model backend did not answer in time.", code="server_error") from None
    finally:
        pool.close(channel, cancel=not channel.finished)
    if isinstance(message, Failed):
        raise ApiError(message.http_status, message.message, code=message.code, param=message.param)
    return message


async def count_tokens(pool: WorkerPool, request: CreateRequest, items: list[dict[str, Any]], model: str, timeout_s: float | None = None, options: DoorOptions = NO_OPTIONS) -> int:
    """Ask a worker how many tokens ``request`` renders to over ``items`` (its input as sent)."""
    from kiln.protocol import CountTokens, TokenCount

    sent = worker_request(request, items, options)
    message = await ask(pool, model, routing_key(request, options.session), lambda req_id: CountTokens(req_id=req_id, request=sent), timeout_s)
    if isinstance(message, TokenCount):
        return message.input_tokens
    raise ApiError(502, "The worker answered a token count with something else.")
