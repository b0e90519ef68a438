"""``POST /v1/completions``: the legacy Completions door, served like the Chat door (``../chat/routes.py``)
with a raw-prompt body and ``text_completion`` framing."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .request import CompletionTranslator, translate_completion
from ..chat.routes import serve_door


async def create_completion(request: Request) -> Response:
    return await serve_door(request, translate_completion, CompletionTranslator)
