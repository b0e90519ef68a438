"""``POST /v1/responses``: create a response, plain or streamed."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..body import read_json
from ..errors import ApiError
from ..generation import Generation, GenerationFailed, terminal_event
from ..response_object import ResponseObject, new_response_id
from ..sse import EventSequencer
from ..validation import validate_create

log = logging.getLogger("kiln.gateway.responses")


async def create_response(request: Request) -> Response:
    state = request.app.state
    body = validate_create(await read_json(request, state.settings.max_body_bytes), hosted_tools=state.settings.hosted_tools)
    model = state.pool.resolve(body["model"])
    if model is None:
        raise ApiError(404, f"The model '{body['model']}' does not exist or is not served here.", code="model_not_found", param="model")
    body["model"] = model
    response = ResponseObject(new_response_id(), body, model)
    generation = Generation(state.pool, response, body, model)
    await generation.open()
    if body["stream"]:
        return StreamingResponse(
            _stream(generation),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        async for _ in generation.events():
            pass
    except GenerationFailed as failure:
        raise failure.api_error()
    return JSONResponse(response.snapshot())


async def _stream(generation: Generation) -> AsyncIterator[bytes]:
    """The SSE body. If the client goes away, Starlette cancels this generator and the
    ``finally`` in ``Generation.events`` tells the worker to stop."""
    seq = EventSequencer()
    response = generation.response
    yield seq.frame({"type": "response.created", "response": response.snapshot()})
    yield seq.frame({"type": "response.in_progress", "response": response.snapshot()})
    try:
        async for event in generation.events():
            yield seq.frame(event)
    except GenerationFailed:
        pass
    yield seq.frame(terminal_event(response))
