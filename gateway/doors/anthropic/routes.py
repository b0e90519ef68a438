"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API as a thin door
onto the same ResponseRun lifecycle as ``/v1/responses`` (admission, worker, store-less, billing).

Errors leave in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with the
status the gateway chose: the app's handler would render OpenAI's, so every ApiError is caught
here. (The hosted middleware's refusals on these paths use the same shape; see accounts.)
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...http.errors import ApiError
from ...lifecycle.generation import GenerationFailed
from ...lifecycle.run import ResponseRun
from ..serving import count_tokens, read_body, serve_translated
from ..serving import service as _service
from .translate import MessageTranslator, error_body, to_responses_body


def _anthropic_errors(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """``route`` with its ApiErrors answered in Anthropic's shape (module docstring)."""

    async def answer(request: Request) -> Response:
        try:
            return await route(request)
        except ApiError as error:
            return JSONResponse(error_body(error.status, error.message), status_code=error.status, headers=dict(error.headers))

    return answer


@_anthropic_errors
async def create_message(request: Request) -> Response:
    spec = to_responses_body(await read_body(request))
    # ``max_tokens`` is required here and clients pick it for Claude models, not this one (Claude
    # Code asks for 32000): above the model's context window it is capped to the window, where
    # /v1/responses would refuse it. The worker then caps it to the room the prompt leaves.
    # The first event is awaited before a stream opens (``status_first``): a request the worker
    # refuses gets its HTTP status, as Anthropic answers.
    return await serve_translated(request, spec.body, stream=spec.stream, cap_to_window=True, status_first=True, framer=lambda run: MessageFramer(
        spec.model, stop_sequences=spec.stop_sequences, show_thinking=spec.show_thinking, seal=_service(request).references.seal_text))


class MessageFramer(MessageTranslator):
    """The Messages door's ``Framer`` (``../framing.py``): Anthropic's SSE events, ``message_start``
    with the prompt's usage (the worker's first message is in), the content blocks, then
    ``message_delta`` with the usage billed (the response's) and ``message_stop``; a failure
    mid-stream ends the stream with an ``error`` event."""

    def frame(self, payload: dict[str, Any]) -> bytes:
        return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

    def opening_frames(self, run: ResponseRun) -> list[bytes]:
        delivered = run.generation.delivered_usage
        return [self.frame(out) for out in self.start_events(delivered.to_map() if delivered is not None else None)]

    def closing_frames(self, run: ResponseRun) -> list[bytes]:
        return [self.frame(out) for out in self.end_events(run.response.status, run.response.data.get("usage"))]

    def error_frames(self, run: ResponseRun, failure: GenerationFailed) -> list[bytes]:
        return [self.frame(error_body(failure.http_status, failure.message))]

    def answer(self, run: ResponseRun, cost: Decimal | None) -> dict[str, Any]:
        message = self.message(run.response.status, run.response.data.get("usage"))
        if cost is not None:
            message["usage"]["cost"] = float(cost)
        return message


@_anthropic_errors
async def count_message_tokens(request: Request) -> Response:
    """The prompt's length in tokens, rendered exactly as a create with the same body would be
    (so it equals that message's ``input_tokens + cache_read_input_tokens``)."""
    spec = to_responses_body(await read_body(request), count_only=True)
    return await count_tokens(request, spec.body, lambda count: {"input_tokens": count})
