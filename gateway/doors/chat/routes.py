"""``POST /v1/chat/completions``: the Chat Completions door, a thin adapter over ``ResponseRun``.

The chat body is translated into a Responses create body (``request.py``), validated,
admitted and run exactly like ``/v1/responses``; the run's events are translated back into chat
chunks (``framer.py``). Stop sequences are cut here: the worker has none, so when one appears
the door cancels the generation and settles the response as completed with the tokens generated
so far, which is also the ``usage`` the client is shown.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...lifecycle.admission import admit
from ...lifecycle.generation import GenerationFailed, complete_usage
from ...lifecycle.response_object import zero_usage
from ...lifecycle.run import ResponseRun
from ..serving import DisconnectWatch, drain_run, options, read_body, start_run, stream_run, validated
from ..serving import owner as _owner
from ..serving import service as _service
from .framer import ChatTranslator
from .request import ChatRequest, translate_chat


def frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def create_chat_completion(request: Request) -> Response:
    return await serve_door(request, translate_chat, ChatTranslator)


async def serve_door(request: Request, translate: Callable[[dict[str, Any]], ChatRequest], translator_class: type[ChatTranslator]) -> Response:
    """A chat-shaped door (Chat Completions, legacy Completions): translate the body, admit,
    validate and run it like ``/v1/responses``, and frame the run with ``translator_class``."""
    service = _service(request)
    chat = translate(await read_body(request))
    ticket = await admit(request, chat.body)
    watch = DisconnectWatch(request)

    async def make_run() -> ResponseRun:
        body = validated(request, chat.body)
        generation, own_input = await service.prepare(body, _owner(request), options=options(request, raw_prompt=chat.raw_prompt))
        return ResponseRun(service, generation, own_input, ticket, streaming=chat.stream)

    run = await start_run(ticket, watch, make_run)
    if isinstance(run, Response):
        return run
    translator = translator_class(run.response.id, run.generation.model, logprobs=chat.logprobs, stop=chat.stop, include_usage=chat.include_usage)
    if chat.stream:
        return await stream_run(run, watch, _stream(run, translator))
    cut = await drain_run(run, watch, _drain(run, translator))
    if cut is not None:
        return cut
    cost = await run.finish()
    return JSONResponse(translator.completion(run.response.status, run.billable_usage(client_gone=False).to_map(), cost))


async def _translated(run: ResponseRun, translator: ChatTranslator) -> AsyncIterator[dict[str, Any]]:
    """The run's chunks; at a stop sequence the generation is cancelled and, once its events end,
    the response is settled as completed with what was generated (usage included)."""
    async for event in run.events():
        for chunk in translator.feed(event):
            yield chunk
        if translator.stopped and not run.generation.cancelled:
            run.generation.cancel()
    if translator.stopped and run.response.status == "cancelled":
        delivered = run.generation.delivered_usage
        run.response.finish("completed", complete_usage(delivered) if delivered else zero_usage())
    for chunk in translator.flush():
        yield chunk


async def _drain(run: ResponseRun, translator: ChatTranslator) -> None:
    async for _ in _translated(run, translator):
        pass


async def _stream(run: ResponseRun, translator: ChatTranslator) -> AsyncIterator[bytes]:
    """The SSE body: chunks, the closing chunk with ``finish_reason``, the usage chunk when asked
    for, ``[DONE]``. A failure mid-stream is sent as an error payload (the OpenAI SDKs raise it).
    If the client goes away Starlette cancels this generator; its ``finally`` finishes the run as
    cut (the worker is told to stop, the delivered part is billed)."""
    try:
        opening = translator.opening()
        if opening is not None:
            yield frame(opening)
        failure: GenerationFailed | None = None
        try:
            async for chunk in _translated(run, translator):
                yield frame(chunk)
        except GenerationFailed as exc:
            failure = exc
        await run.finish()  # before the last chunks leave
        if failure is not None:
            yield frame(failure.api_error().body())
        else:
            yield frame(translator.closing(run.response.status))
            if translator.include_usage:
                yield frame(translator.usage_chunk(run.billable_usage(client_gone=False).to_map()))
        yield DONE
    finally:
        await run.finish(client_gone=True)  # a no-op when the run finished above
