"""The ``/v1/responses`` endpoints: thin HTTP adapters over ``ResponsesService``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...http.errors import invalid
from ...http.routes.pagination import item_page
from ...http.sse import EventSequencer, frame_numbered
from ...lifecycle.admission import admit
from ...lifecycle.run import ResponseRun
from ...store.events import TooOld
from ..framing import ResponseFramer, with_cost
from ..serving import SSE_HEADERS, ClientDisconnected, DisconnectWatch, count_tokens, options, read_body, serve, start_run, validated, while_connected
from ..serving import owner as _owner
from ..serving import service as _service
from ..validation import parse_bool, validate_create


async def create_response(request: Request) -> Response:
    service = _service(request)
    raw = await read_body(request)
    ticket = await admit(request, raw)
    watch = DisconnectWatch(request)
    opening: dict[str, Any] = {}

    async def make_run() -> ResponseRun | Response:
        create = validated(request, raw)
        generation, own_input = await service.prepare(create, _owner(request), options=options(request))
        if create.background:
            return JSONResponse(await service.jobs.start(generation, own_input))
        opening.update(generation.response.snapshot())  # as it stands before any compaction work
        return ResponseRun(service, generation, own_input, ticket, streaming=create.stream)

    run = await start_run(ticket, watch, make_run)
    if isinstance(run, Response):
        return run
    generation = run.generation  # a stored stream records its events for streamed retrieval
    return await serve(run, watch, ResponseFramer(opening, lambda: EventSequencer(on_event=service.stream_recorder(generation)).frame))


async def get_response(request: Request) -> Response:
    params = request.query_params
    rid = request.path_params["response_id"]
    if not parse_bool(params.get("stream", "false"), "stream"):
        return JSONResponse(await _service(request).retrieval.get(rid, _owner(request)))
    after = params.get("starting_after")
    starting_after = None
    if after is not None:
        try:
            starting_after = int(after)
        except ValueError:
            raise invalid("Invalid 'starting_after': expected an integer sequence number.", param="starting_after") from None
    reader = await _service(request).retrieval.event_stream(rid, _owner(request))
    events = reader.follow(starting_after)
    try:
        first = await events.__anext__()
    except TooOld as too_old:
        raise invalid(f"Invalid 'starting_after': events up to sequence number {too_old.oldest - 1} are no longer kept for '{rid}'.", param="starting_after") from too_old
    except StopAsyncIteration:
        first = None
    return StreamingResponse(_replay(first, events), media_type="text/event-stream", headers=SSE_HEADERS)


async def _replay(first: dict[str, Any] | None, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Recorded events, already numbered; a client that leaves only stops its own reading."""
    if first is None:
        return
    yield frame_numbered(first)
    async for event in events:
        yield frame_numbered(event)


async def delete_response(request: Request) -> Response:
    return JSONResponse(await _service(request).retrieval.delete(request.path_params["response_id"], _owner(request)))


async def cancel_response(request: Request) -> Response:
    return JSONResponse(await _service(request).retrieval.cancel(request.path_params["response_id"], _owner(request)))


async def list_input_items(request: Request) -> Response:
    items = await _service(request).retrieval.input_items(request.path_params["response_id"], _owner(request))
    return JSONResponse(item_page(items, request.query_params, unknown_after="no input item '{id}'"))


async def compact_response(request: Request) -> Response:
    settings = request.app.state.settings
    raw = await read_body(request)
    ticket = await admit(request, raw)
    try:
        for key in ("stream", "previous_response_id", "conversation"):
            if raw.get(key) not in (None, False):
                raise invalid(f"'{key}' is not supported by /responses/compact; send the full history in 'input'.", param=key)
        create = validate_create(raw, hosted_tools=settings.hosted_tools)
        max_out = raw.get("max_output_tokens")
        if max_out is not None and (isinstance(max_out, bool) or not isinstance(max_out, int) or not 1 <= max_out <= 16384):
            raise invalid("Invalid 'max_output_tokens': expected 1 to 16384.", param="max_output_tokens")
        watch = DisconnectWatch(request)
        try:
            resource = await while_connected(watch, _service(request).compact_endpoint(create, raw.get("keep_tokens"), _owner(request)))
        finally:
            await watch.stop()
        cost = await ticket.settle("completed", resource.get("usage"))
        return JSONResponse(with_cost(resource, cost))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await ticket.close()


async def input_tokens(request: Request) -> Response:
    return await count_tokens(request, await read_body(request), lambda count: {"object": "response.input_tokens", "input_tokens": count})
