"""``POST /v1/chat/completions``: the Chat Completions door, a thin adapter over ``ResponseRun``.

The chat body is translated into a Responses create body (``request.py``), validated,
admitted and run exactly like ``/v1/responses`` (``serving.serve_translated``); the run's events
are translated back into chat chunks (``framer.py``). Stop sequences are cut by the translator and
end the generation as in every door (``framing.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..serving import read_body, serve_translated
from .framer import ChatTranslator
from .request import ChatRequest, translate_chat


async def create_chat_completion(request: Request) -> Response:
    return await serve_door(request, translate_chat, ChatTranslator)


async def serve_door(request: Request, translate: Callable[[dict[str, Any]], ChatRequest], translator_class: type[ChatTranslator]) -> Response:
    """A chat-shaped door (Chat Completions, legacy Completions): translate the body and serve it
    like ``/v1/responses``, framed by ``translator_class``."""
    chat = translate(await read_body(request))
    return await serve_translated(request, chat.body, stream=chat.stream, raw_prompt=chat.raw_prompt,
        framer=lambda run: translator_class(run.response.id, run.generation.model, logprobs=chat.logprobs, stop=chat.stop, include_usage=chat.include_usage))
