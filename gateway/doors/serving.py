"""What every HTTP door shares, so that a door (Responses, Chat Completions, Anthropic Messages)
is only its translation: reading the body, noticing a client that hung up, starting a run, and
answering it as a stream or as one body.

The order is the same for every door: read the body (bounded), admit it (``gateway/lifecycle/admission.py``),
then ``start_run`` (validate, prepare, run the compaction phase and open a worker while the client
is still there), then ``stream_run`` or ``drain_run``. Every exit path closes the admission ticket
or finishes the run, so nothing is left reserved, held or running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import HTTPConnection, Request
from starlette.responses import Response, StreamingResponse

from ..lifecycle.admission import Ticket
from ..http.body import read_json
from .options import DoorOptions
from ..http.errors import invalid
from ..lifecycle.generation import GenerationFailed, terminal_event
from ..lifecycle.run import ResponseRun
from ..lifecycle.service import ResponsesService
from .validation import validate_create
from ..pool.workers import SESSION_HEADERS

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


def validated(request: HTTPConnection, raw: dict[str, Any]) -> dict[str, Any]:
    """A Responses create body (client fields only), validated and with the server's defaults
    applied."""
    settings = request.app.state.settings
    body = validate_create(raw, hosted_tools=settings.hosted_tools, truncation_auto=settings.truncation_auto)
    if body.get("temperature") is None and settings.default_temperature is not None:
        body["temperature"] = settings.default_temperature  # echoed, so clients see what ran
    if body.get("frequency_penalty") is None and settings.default_frequency_penalty is not None:
        body["frequency_penalty"] = settings.default_frequency_penalty  # echoed too
    return body


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
        if isinstance(run, Response):
            await watch.stop()
            await ticket.close()
            return run
        await while_connected(watch, run.start())
        return run
    except ClientDisconnected:
        await watch.stop()
        await ticket.close()
        return Response(status_code=499)
    except BaseException:
        await watch.stop()
        await ticket.close()
        raise


async def response_stream(run: ResponseRun, opening: dict[str, Any], *, quiet: bool = False, finishing: Callable[[], None] | None = None, finished: Callable[[], None] | None = None) -> AsyncIterator[dict[str, Any]]:
    """A started run as the Responses stream, for the SSE and WebSocket doors alike (each numbers
    and frames the events its way): ``response.created`` and ``response.in_progress`` carrying
    ``opening``, the run's events, then the terminal event once the run is finished (billed and
    stored before the client can see it end). A failure mid-stream ends it ``response.failed``.

    ``quiet``: the run's own events are not passed on (a warm-up turn). ``finishing`` runs before
    the run is finished, ``finished`` after, both before the terminal event. The caller's
    ``finally`` finishes the run as cut (``run.finish(client_gone=True)``) if the client left."""
    yield {"type": "response.created", "response": opening}
    yield {"type": "response.in_progress", "response": opening}
    try:
        async for event in run.events():
            if not quiet:
                yield event
    except GenerationFailed:
        pass
    if finishing is not None:
        finishing()
    await run.finish()  # before the terminal event leaves
    if finished is not None:
        finished()
    yield terminal_event(run.response)


async def stream_run(run: ResponseRun, watch: DisconnectWatch, body: AsyncIterator[bytes]) -> Response:
    """The streaming answer; ``body``'s ``finally`` must finish the run as cut (see
    doors/responses/routes.py ``_stream``). From here on the streaming response watches the client."""
    if await watch.stop():
        await run.finish(client_gone=True)
        return Response(status_code=499)
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


async def drain_run(run: ResponseRun, watch: DisconnectWatch, drain: Awaitable[None]) -> Response | None:
    """Run a non-streaming answer to its end and finish it before its body is sent, so a client
    that gets the body is billed. Returns a 499 Response when the client left first, None when
    the door may answer (``await run.finish()`` then gives the cost); raises the ApiError of a
    failed run."""
    try:
        await while_connected(watch, drain)
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
