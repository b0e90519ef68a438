"""What every HTTP door shares, so that a door (Responses, Chat Completions, Anthropic Messages)
is only its parser and its framer (``framing.py``): reading the body, noticing a client that hung
up, starting a run, and answering it as a stream or as one body.

The order is the same for every door: read the body (bounded), admit it (``gateway/lifecycle/admission.py``),
then ``start_run`` (validate, prepare, run the compaction phase and open a worker while the client
is still there), then ``serve`` (stream or drain it through the door's framer, finish it).
``serve_translated`` is that whole path for a door that parses its body into a Responses create
body. Every exit path closes the admission ticket or finishes the run, so nothing is left
reserved, held or running.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..http.body import read_json
from ..http.errors import invalid
from ..lifecycle.admission import Ticket, admit
from ..lifecycle.generation import GenerationFailed, RunEvent
from ..lifecycle.run import ResponseRun
from ..lifecycle.service import ResponsesService
from ..pool.workers import SESSION_HEADERS
from .create_request import CreateRequest
from .framing import Framer, drain, frames
from .options import DoorOptions
from .validation import validate_create

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def service(request: Request) -> ResponsesService:
    return request.app.state.responses  # type: ignore[no-any-return]


def owner(request: Request) -> object:
    """The organization of an authenticated request (hosted mode); None when auth is off."""
    principal = request.scope.get("kiln.principal")
    return getattr(principal, "org_id", None)


async def read_body(request: Request) -> dict[str, Any]:
    """The request body as a JSON object (bounded; 400/413 otherwise)."""
    raw = await read_json(request, request.app.state.settings.max_body_bytes)
    if not isinstance(raw, dict):
        raise invalid("The request body must be a JSON object.")
    return raw


def validated(request: HTTPConnection, raw: dict[str, Any]) -> CreateRequest:
    """A Responses create body as the typed request, with the server's sampling defaults applied
    where the client set none (echoed, so clients see what ran)."""
    settings = request.app.state.settings
    create = validate_create(raw, hosted_tools=settings.hosted_tools, truncation_auto=settings.truncation_auto)
    return dataclasses.replace(
        create,
        temperature=settings.default_temperature if create.temperature is None else create.temperature,
        frequency_penalty=settings.default_frequency_penalty if create.frequency_penalty is None else create.frequency_penalty,
    )


def session(request: HTTPConnection) -> str | None:
    """The client's session header (Codex sends ``session-id`` on every turn), which keeps its
    requests on one worker when they carry no ``prompt_cache_key``."""
    value = next((request.headers[h] for h in SESSION_HEADERS if request.headers.get(h)), None)
    return None if value is None else value[:256]


def options(request: HTTPConnection, **decided: Any) -> DoorOptions:
    """The door's options for ``request``: its session header and what the door ``decided``."""
    return DoorOptions(session=session(request), **decided)


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


class DisconnectWatch:
    """Notices, once per request, that the client hung up (the body has been read, so nothing
    else arrives on the channel but the disconnect).

    One watcher for the whole request, not one per awaited step: a disconnect that arrives just
    as one step finishes is then never lost between two steps."""

    def __init__(self, request: Request) -> None:
        self.gone = asyncio.Event()
        self._task = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone.set()

    async def stop(self) -> bool:
        """Stop watching (a streaming response listens itself from here on); True if the client
        has already gone."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.gone.is_set()


async def while_connected(watch: DisconnectWatch, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it, which closes its
    worker channel and tells the worker to stop, and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(watch.gone.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        gone.cancel()
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def start_run(ticket: Ticket, watch: DisconnectWatch, make_run: Callable[[], Awaitable[ResponseRun | Response]]) -> ResponseRun | Response:
    """Build the run (``make_run`` validates and prepares; it may answer at once with a Response,
    e.g. a background job) and start it while the client is there (compaction can run for a while
    before the first event: a client that gives up meanwhile must not leave it on a worker).

    Returns the started run, or the Response to send (499 when the client left). On any failure
    the ticket is closed (recorded unbilled) and the error propagates."""
    try:
        run = await make_run()
        if not isinstance(run, Response):
            await while_connected(watch, run.start())
            return run
    except ClientDisconnected:
        run = Response(status_code=499)
    except BaseException:
        await watch.stop()
        await ticket.close()
        raise
    await watch.stop()
    await ticket.close()
    return run


async def serve_translated(request: Request, body: dict[str, Any], *, stream: bool, framer: Callable[[ResponseRun], Framer[bytes]], status_first: bool = False,
    **decided: Any) -> Response:
    """A door that parsed its request into the Responses create ``body``: admit it, validate and
    prepare it like ``/v1/responses`` with what the door ``decided`` (``DoorOptions``), start it,
    and serve it through ``framer(run)``."""
    responses = service(request)
    ticket = await admit(request, body)
    watch = DisconnectWatch(request)

    async def make_run() -> ResponseRun:
        generation, own_input = await responses.prepare(validated(request, body), owner(request), options=options(request, **decided))
        return ResponseRun(responses, generation, own_input, ticket, streaming=stream)

    run = await start_run(ticket, watch, make_run)
    if isinstance(run, Response):
        return run
    return await serve(run, watch, framer(run), status_first=status_first)


async def serve(run: ResponseRun, watch: DisconnectWatch, framer: Framer[bytes], *, status_first: bool = False) -> Response:
    """A started run's answer: an SSE stream of ``framer``'s frames, or its one body once the run
    is finished (so a client that gets the body is billed); 499 when the client left first.

    ``status_first``: the first event is awaited before the stream opens, so that a request the
    worker refuses (the prompt does not fit the context window) gets its HTTP status rather than
    a 200 with an error event (as Anthropic answers)."""
    if not run.streaming:
        cut = await _drained(run, watch, framer)
        return cut if cut is not None else JSONResponse(framer.answer(run, await run.finish()))
    events = run.events()
    if status_first:
        first = await _first_event(run, watch, events)
        if isinstance(first, Response):
            return first
        events = _chained(first, events)
    if await watch.stop():  # from here on the streaming response watches the client
        await run.finish(client_gone=True)
        return Response(status_code=499)
    body: AsyncIterator[bytes] = frames(run, framer, events)
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


async def _drained(run: ResponseRun, watch: DisconnectWatch, framer: Framer[bytes]) -> Response | None:
    """Run a non-streaming answer to its end and finish it. Returns a 499 Response when the client
    left first, None when the door may answer (``await run.finish()`` then gives the cost); raises
    the ApiError of a failed run."""
    try:
        await while_connected(watch, drain(run, framer))
    except GenerationFailed as failure:
        await run.finish()
        raise failure.api_error() from None
    except ClientDisconnected:
        await run.finish(client_gone=True)
        return Response(status_code=499)
    finally:
        await watch.stop()
        await run.finish()
    if run.refusal is not None:
        raise run.refusal  # generated, but the store could not keep it: nothing was acknowledged
    return None


async def _first_event(run: ResponseRun, watch: DisconnectWatch, events: AsyncIterator[RunEvent]) -> RunEvent | None | Response:
    """The run's first event (None: there is none) while the client is there; a failure finishes
    the run and raises its ApiError, a client that left gets 499."""
    try:
        return await while_connected(watch, anext(events, None))
    except BaseException as exc:
        await watch.stop()
        await run.finish(client_gone=not isinstance(exc, GenerationFailed))
        if isinstance(exc, GenerationFailed):
            raise exc.api_error() from exc
        if isinstance(exc, ClientDisconnected):
            return Response(status_code=499)
        raise


async def _chained(first: RunEvent | None, events: AsyncIterator[RunEvent]) -> AsyncIterator[RunEvent]:
    if first is not None:
        yield first
        async for event in events:
            yield event


async def count_tokens(request: Request, body: dict[str, Any], answer: Callable[[int], dict[str, Any]]) -> Response:
    """The length in tokens of the prompt a create with ``body`` (a Responses create body) would
    render, as the door's ``answer``; admitted for the key's scope, credits and concurrency, not
    billed; 499 when the client left first."""
    ticket = await admit(request, body, reserve=False)
    try:
        checked = validated(request, body)
        watch = DisconnectWatch(request)
        try:
            count = await while_connected(watch, service(request).count_input_tokens(checked, owner(request), options(request)))
        finally:
            await watch.stop()
        return JSONResponse(answer(count))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await ticket.close()
