"""The ``/v1/responses`` endpoints: thin HTTP adapters over ``ResponsesService``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from decimal import Decimal
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..admission import admit
from ..body import read_json
from ..errors import invalid
from ..generation import GenerationFailed, count_tokens, terminal_event
from ..lifecycle import ResponseRun
from ..compaction import expand_items
from ..history import expand
from ..responses_service import ResponsesService
from ..sse import EventSequencer, frame_numbered
from ..store.events import TooOld
from ..validation import parse_bool, validate_create
from ..workers import SESSION_FIELD, SESSION_HEADERS


T = TypeVar("T")


def _service(request: Request) -> ResponsesService:
    return request.app.state.responses


def _owner(request: Request) -> object:
    """The organization of an authenticated request (hosted mode); None when auth is off."""
    principal = request.scope.get("kiln.principal")
    return getattr(principal, "org_id", None)


async def _read(request: Request) -> dict:
    """The request body as a JSON object (bounded; 400/413 otherwise)."""
    raw = await read_json(request, request.app.state.settings.max_body_bytes)
    if not isinstance(raw, dict):
        raise invalid("The request body must be a JSON object.")
    # Set only by the legacy /v1/completions door on the body it builds (the worker then skips
    # the chat template); never taken from a client.
    raw.pop("raw_prompt", None)
    return raw


def _validated(request: Request, raw: dict) -> dict:
    settings = request.app.state.settings
    body = validate_create(raw, hosted_tools=settings.hosted_tools)
    if body.get("temperature") is None and settings.default_temperature is not None:
        body["temperature"] = settings.default_temperature  # echoed, so clients see what ran
    session = next((request.headers[h] for h in SESSION_HEADERS if request.headers.get(h)), None)
    if session is not None:
        body[SESSION_FIELD] = session[:256]
    return body


def _with_cost(payload: dict, cost: Decimal | None) -> dict:
    """A non-streaming body with the hosted contract's ``usage.cost`` (USD) when one was debited."""
    if cost is None or not isinstance(payload.get("usage"), dict):
        return payload
    return {**payload, "usage": {**payload["usage"], "cost": float(cost)}}


async def create_response(request: Request) -> Response:
    service = _service(request)
    raw = await _read(request)
    ticket = await admit(request, raw)
    watch = DisconnectWatch(request)
    try:
        body = _validated(request, raw)
        generation, own_input = service.prepare(body, _owner(request))
        if body["background"]:
            return JSONResponse(await service.start_background(generation, own_input))
        run = ResponseRun(service, generation, own_input, ticket, streaming=body["stream"])
        opening = generation.response.snapshot()  # as it stands before any compaction work
        # Compaction can run for a while before the stream opens: a client that gives up
        # meanwhile must not leave it running on a worker.
        await _while_connected(watch, run.start())
    except ClientDisconnected:
        await watch.stop()
        await ticket.close()
        return Response(status_code=499)
    except BaseException:
        await watch.stop()
        await ticket.close()
        raise
    if body["stream"]:
        if await watch.stop():
            await run.finish(client_gone=True)
            return Response(status_code=499)
        return StreamingResponse(
            _stream(run, opening),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        await _while_connected(watch, _drain(run))
    except GenerationFailed as failure:
        await run.finish()
        raise failure.api_error()
    except ClientDisconnected:
        await run.finish(client_gone=True)
        return Response(status_code=499)
    finally:
        await watch.stop()
        cost = await run.finish()  # before the body leaves: a client that got it is billed
    return JSONResponse(_with_cost(generation.response.snapshot(), cost))


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


async def _drain(run: ResponseRun) -> None:
    async for _ in run.events():
        pass


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


async def _while_connected(watch: DisconnectWatch, work: Awaitable[T]) -> T:
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


async def _stream(run: ResponseRun, opening: dict) -> AsyncIterator[bytes]:
    """The SSE body. If the client goes away Starlette cancels this generator; its ``finally``
    then finishes the run as cut (the worker is told to stop, the delivered part is billed)."""
    seq = EventSequencer(on_event=run.service.stream_recorder(run.generation))  # streamed retrieval
    try:
        yield seq.frame({"type": "response.created", "response": opening})
        yield seq.frame({"type": "response.in_progress", "response": opening})
        try:
            async for event in run.events():
                yield seq.frame(event)
        except GenerationFailed:
            pass
        await run.finish()  # before the terminal event leaves
        yield seq.frame(terminal_event(run.response))
    finally:
        await run.finish(client_gone=True)  # a no-op when the run finished above


async def get_response(request: Request) -> Response:
    params = request.query_params
    rid = request.path_params["response_id"]
    if not parse_bool(params.get("stream", "false"), "stream"):
        return JSONResponse(_service(request).get(rid, _owner(request)))
    after = params.get("starting_after")
    starting_after = None
    if after is not None:
        try:
            starting_after = int(after)
        except ValueError:
            raise invalid("Invalid 'starting_after': expected an integer sequence number.", param="starting_after")
    buffer = _service(request).event_stream(rid, _owner(request))
    events = buffer.follow(starting_after)
    try:
        first = await events.__anext__()
    except TooOld as too_old:
        raise invalid(f"Invalid 'starting_after': events up to sequence number {too_old.oldest - 1} are no longer kept for '{rid}'.", param="starting_after")
    except StopAsyncIteration:
        first = None
    return StreamingResponse(_replay(first, events), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _replay(first: dict | None, events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Recorded events, already numbered; a client that leaves only stops its own reading."""
    if first is None:
        return
    yield frame_numbered(first)
    async for event in events:
        yield frame_numbered(event)


async def delete_response(request: Request) -> Response:
    return JSONResponse(_service(request).delete(request.path_params["response_id"], _owner(request)))


async def cancel_response(request: Request) -> Response:
    return JSONResponse(await _service(request).cancel(request.path_params["response_id"], _owner(request)))


async def list_input_items(request: Request) -> Response:
    items = _service(request).input_items(request.path_params["response_id"], _owner(request))
    params = request.query_params
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("Invalid 'order': expected 'asc' or 'desc'.", param="order")
    try:
        limit = int(params.get("limit", "20"))
    except ValueError:
        raise invalid("Invalid 'limit': expected an integer.", param="limit")
    if not 1 <= limit <= 100:
        raise invalid("Invalid 'limit': expected 1 to 100.", param="limit")
    ordered = list(reversed(items)) if order == "desc" else list(items)
    after = params.get("after")
    if after is not None:
        ids = [i.get("id") for i in ordered]
        if after not in ids:
            raise invalid(f"Invalid 'after': no input item '{after}'.", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None,
            "has_more": len(ordered) > limit,
        }
    )


async def compact_response(request: Request) -> Response:
    settings = request.app.state.settings
    raw = await _read(request)
    ticket = await admit(request, raw)
    try:
        for key in ("stream", "previous_response_id", "conversation"):
            if raw.get(key) not in (None, False):
                raise invalid(f"'{key}' is not supported by /responses/compact; send the full history in 'input'.", param=key)
        body = validate_create({k: v for k, v in raw.items() if k not in ("keep_tokens",)}, hosted_tools=settings.hosted_tools)
        if "keep_tokens" in raw:
            body["keep_tokens"] = raw["keep_tokens"]
        max_out = raw.get("max_output_tokens")
        if max_out is not None and (isinstance(max_out, bool) or not isinstance(max_out, int) or not 1 <= max_out <= 16384):
            raise invalid("Invalid 'max_output_tokens': expected 1 to 16384.", param="max_output_tokens")
        watch = DisconnectWatch(request)
        try:
            resource = await _while_connected(watch, _service(request).compact_endpoint(body))
        finally:
            await watch.stop()
        cost = await ticket.settle("completed", resource.get("usage"))
        return JSONResponse(_with_cost(resource, cost))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await ticket.close()


async def input_tokens(request: Request) -> Response:
    service = _service(request)
    raw = await _read(request)
    ticket = await admit(request, raw, reserve=False)  # key scope, credits, concurrency; not billed
    try:
        body = _validated(request, raw)
        model = service.pool.require(body["model"])
        body["model"] = model
        history = expand(body, store=service.store, jobs=service.jobs, conversations=service.conversations, store_mode=service.settings.store_mode, owner=_owner(request))
        body["input"] = expand_items(service.reasoning_echo.restore(history + service.unseal_items(service.resolve_references(body["input"], _owner(request))), _owner(request)), service.sealer)
        watch = DisconnectWatch(request)
        try:
            count = await _while_connected(watch, count_tokens(service.pool, body, model, service.settings.first_event_timeout_s))
        finally:
            await watch.stop()
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await ticket.close()
