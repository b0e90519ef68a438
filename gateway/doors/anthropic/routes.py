"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API as a thin door
onto the same ResponseRun lifecycle as ``/v1/responses`` (admission, worker, store-less, billing).

Errors leave in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with the
status the gateway chose: the app's handler would render OpenAI's, so every ApiError is caught
here. (The hosted middleware's refusals on these paths use the same shape; see accounts.)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...lifecycle.admission import admit
from .translate import (
    MessagesRequest,
    MessageTranslator,
    error_body,
    to_responses_body,
)
from ...http.errors import ApiError
from ...lifecycle.generation import GenerationFailed, complete_usage
from ...lifecycle.run import ResponseRun
from ..serving import ClientDisconnected, DisconnectWatch, drain_run, options, read_body, start_run, stream_run, validated, while_connected
from ..serving import owner as _owner
from ..serving import service as _service


def _error(error: ApiError) -> JSONResponse:
    headers = {k: v for k, v in error.headers.items()}
    return JSONResponse(error_body(error.status, error.message), status_code=error.status, headers=headers)


def _frame(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def _final_usage(run: ResponseRun) -> dict[str, Any] | None:
    """The usage the client is told, which is the usage billed."""
    usage: dict[str, Any] | None = run.response.data.get("usage")
    return usage


def _translator(request: Request, spec: MessagesRequest) -> MessageTranslator:
    return MessageTranslator(spec.model, stop_sequences=spec.stop_sequences, show_thinking=spec.show_thinking, seal=_service(request).references.seal_text)


async def create_message(request: Request) -> Response:
    try:
        return await _create(request)
    except ApiError as error:
        return _error(error)


async def _create(request: Request) -> Response:
    service = _service(request)
    raw = await read_body(request)
    spec = to_responses_body(raw)
    ticket = await admit(request, spec.body)
    watch = DisconnectWatch(request)

    async def make_run() -> ResponseRun:
        body = validated(request, spec.body)
        # ``max_tokens`` is required here and clients pick it for Claude models, not this one
        # (Claude Code asks for 32000): above the model's context window it is capped to the
        # window, where /v1/responses would refuse it. The worker then caps it to the room the
        # prompt leaves.
        generation, own_input = await service.prepare(body, _owner(request), options=options(request, cap_to_window=True))
        return ResponseRun(service, generation, own_input, ticket, streaming=spec.stream)

    run = await start_run(ticket, watch, make_run)
    if isinstance(run, Response):
        return run
    translator = _translator(request, spec)
    if spec.stream:
        # The first event is awaited before the stream opens, so that a request refused by the
        # worker (the prompt does not fit the context window) gets its HTTP status, as Anthropic
        # answers, rather than a 200 with an error event.
        events = run.events()
        try:
            first = await while_connected(watch, _first(events))
        except GenerationFailed as failure:
            await watch.stop()
            await run.finish()
            raise failure.api_error()
        except ClientDisconnected:
            await watch.stop()
            await run.finish(client_gone=True)
            return Response(status_code=499)
        except BaseException:
            await watch.stop()
            await run.finish(client_gone=True)
            raise
        return await stream_run(run, watch, _stream(run, translator, events, first))
    cut = await drain_run(run, watch, _drain(run, translator))
    if cut is not None:
        return cut
    cost = await run.finish()
    message = translator.message(run.response.status, _final_usage(run))
    if cost is not None:
        message["usage"]["cost"] = float(cost)
    return JSONResponse(message)


async def _drain(run: ResponseRun, translator: MessageTranslator) -> None:
    events = run.events()
    async for event in events:
        translator.feed(event)
        if translator.stopped:
            await _stop_at_sequence(run, events)
            return


async def _stop_at_sequence(run: ResponseRun, events: AsyncIterator[dict[str, Any]]) -> None:
    """A stop sequence ended the message: close the worker channel (the worker stops) and finish
    the response as completed with the usage of what was generated, which is what is billed."""
    await events.aclose()  # type: ignore[attr-defined]
    run.response.finish("completed", complete_usage(run.generation.delivered_usage))


async def _first(events: AsyncIterator[dict[str, Any]]) -> dict[str, Any] | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _chained(first: dict[str, Any] | None, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    if first is not None:
        yield first
        async for event in events:
            yield event


async def _stream(run: ResponseRun, translator: MessageTranslator, events: AsyncIterator[dict[str, Any]], first: dict[str, Any] | None) -> AsyncIterator[bytes]:
    """The SSE body, once the worker's first message is in (so ``message_start`` carries the
    prompt's token count). A client that leaves cancels this generator, whose ``finally``
    finishes the run as cut; a failure later on ends the stream with an ``error`` event."""
    try:
        delivered = run.generation.delivered_usage
        for out in translator.start_events(delivered.to_map() if delivered is not None else None):
            yield _frame(out)
        try:
            async for event in _chained(first, events):
                for out in translator.feed(event):
                    yield _frame(out)
                if translator.stopped:
                    await _stop_at_sequence(run, events)
                    break
        except GenerationFailed as failure:
            await run.finish()
            yield _frame(error_body(failure.http_status, failure.message))
            return
        await run.finish()  # before the last events leave
        for out in translator.end_events(run.response.status, _final_usage(run)):
            yield _frame(out)
    finally:
        await run.finish(client_gone=True)  # a no-op when the run finished above


async def count_message_tokens(request: Request) -> Response:
    try:
        return await _count(request)
    except ApiError as error:
        return _error(error)


async def _count(request: Request) -> Response:
    """The prompt's length in tokens, rendered exactly as a create with the same body would be
    (so it equals that message's ``input_tokens + cache_read_input_tokens``)."""
    service = _service(request)
    raw = await read_body(request)
    spec = to_responses_body(raw, count_only=True)
    ticket = await admit(request, spec.body, reserve=False)  # key scope, credits; not billed
    try:
        body = validated(request, spec.body)
        watch = DisconnectWatch(request)
        try:
            count = await while_connected(watch, service.count_input_tokens(body, _owner(request), options(request)))
        finally:
            await watch.stop()
        return JSONResponse({"input_tokens": count})
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await ticket.close()
