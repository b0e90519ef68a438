"""Refusing a WebSocket upgrade with a real HTTP answer (status, headers, an OpenAI error body).

Clients decide what to do from the upgrade's HTTP status: Codex falls back to HTTP/SSE cleanly on
426 only, the OpenAI SDK surfaces 401/403 as such. A plain ``websocket.close`` before accepting
would be answered 403 by the server whatever the reason, so the edge, the accounts middleware and
the route all refuse through here, with ASGI's ``websocket.http.response`` extension (Hypercorn
has it); only a server without the extension gets the close.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from .errors import ApiError

WEBSOCKET_PATHS = frozenset({"/v1/responses", "/responses"})
_DENIAL = "websocket.http.response"


async def deny_upgrade(scope: dict[str, Any], receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]], error: ApiError) -> None:
    """Answer a WebSocket handshake with ``error`` as an HTTP response instead of accepting it."""
    message = await receive()  # websocket.connect: the handshake, before any answer
    if message.get("type") != "websocket.connect":
        return  # the client has already gone
    if _DENIAL in (scope.get("extensions") or {}):
        await error.response()(scope, receive, send)  # Starlette sends websocket.http.response.*
        return
    await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
