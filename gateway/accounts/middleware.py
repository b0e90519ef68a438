"""The hosted request path's front: a pure ASGI middleware that authenticates, nothing more.

Active when the gateway runs with ``--auth keys``. For every API path (all but ``/health``,
``/admin/...`` and the web pages: ``/``, ``/ui/...``) it answers 503 during maintenance and authenticates ``Authorization: Bearer``
(401) before anything else runs -- in particular before a byte of the body is read, so a caller
without a key cannot make the gateway buffer anything. The principal goes in the ASGI scope for
the routes.

For the metered paths (create, compact, input_tokens) it also mints the generation id and puts it in
``X-Neocloud-Generation-Id`` and ``X-Kiln-Generation-Id`` on every response of the request, streamed
ones and refusals included, and holds one of the organization's concurrency slots (429
``rate_limit_exceeded``) from authentication until the answer has ended, however it ends. Admission (catalog, key scope, credits, concurrency) and metering are
not here: the routes admit through ``accounts/admission.py`` once the body is parsed, and the
response lifecycle settles the ticket with the usage it holds as a value (no re-parsing of our own
bytes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping
from typing import Any

import anyio
from starlette.types import Message, Receive, Scope, Send

from kiln.gateway.doors.anthropic.translate import error_body, is_messages_path
from kiln.gateway.http.errors import ApiError

from .metering import new_generation_id
from .service import Accounts

log = logging.getLogger("kiln.gateway.accounts")


# The paths whose requests a generation id names (their ledger rows, or their refusals).
METERED_PATHS = frozenset({
    "/v1/responses", "/responses",
    "/v1/responses/compact", "/responses/compact",
    "/v1/responses/input_tokens", "/responses/input_tokens",
    "/v1/chat/completions", "/chat/completions",
    "/v1/completions", "/completions",
    "/v1/messages", "/messages",
    "/v1/messages/count_tokens", "/messages/count_tokens",
})
OPEN_PATHS = frozenset({"/health"})
# The web pages and their files (gateway/web/): static, public, and each signs in on its own.
OPEN_PREFIXES = ("/admin/", "/ui/")
GENERATION_HEADERS = (b"x-neocloud-generation-id", b"x-kiln-generation-id")
PRINCIPAL_SCOPE_KEY = "kiln.principal"
SLOT_SCOPE_KEY = "kiln.slot"  # the organization's concurrency slot; the lifecycle may free it early
GENERATION_SCOPE_KEY = "kiln.generation_id"


def _json_bytes(obj: Any) -> bytes:
    # The same encoding as Starlette's JSONResponse.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


async def send_api_error(send: Send, error: ApiError, path: str = "") -> None:
    """The refusal in the shape of the API the path belongs to (Anthropic's on its door)."""
    body = _json_bytes(error_body(error.status, error.message) if is_messages_path(path) else error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def check_maintenance(accounts: Accounts) -> None:
    """Raise the maintenance 503 while the switch is on (raises the backend's error when the
    switch cannot be read: the caller fails closed)."""
    on, retry_after = await accounts.maintenance.state()
    if on:
        raise maintenance_error(retry_after)


async def socket_principal(accounts: Accounts, scope: MutableMapping[str, Any]) -> Any:
    """What a WebSocket's upgrade checks, and each of its turns again (a socket lives an hour;
    a key revoked or a maintenance switched on meanwhile must stop it): maintenance, then the key
    of the upgrade's headers, looked up afresh (the auth cache's TTL bounds the delay). Raises the
    ApiError to answer, 503 when the accounts backend is down."""
    try:
        await check_maintenance(accounts)
        assert accounts.auth is not None
        return await accounts.auth.authenticate(AccountsMiddleware._authorization(scope), None, require_credits=False)
    except ApiError:
        raise
    except Exception as exc:  # the accounts database or Redis is down
        raise accounts_unavailable(exc) from None


def maintenance_error(seconds: int) -> ApiError:
    return ApiError(503, f"The API is down for maintenance. Retry after {seconds} seconds.", headers={"Retry-After": str(seconds)})


def accounts_unavailable(exc: BaseException) -> ApiError:
    log.error("accounts backend unavailable", exc_info=exc)
    return ApiError(503, "The service is temporarily unavailable. Retry with exponential backoff.", headers={"Retry-After": "5"})


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped


class AccountsMiddleware:
    """Pure ASGI: it must answer before the body is read and add headers to streamed answers."""

    def __init__(self, app: Any, accounts: Accounts) -> None:
        self.app = app
        self.accounts = accounts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in OPEN_PATHS or path in ("/", "/admin") or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        metered = scope["method"] == "POST" and path in METERED_PATHS
        if metered:
            generation_id = new_generation_id()
            scope[GENERATION_SCOPE_KEY] = generation_id
            send = _with_headers(send, [(name, generation_id.encode()) for name in GENERATION_HEADERS])
        accounts = self.accounts
        slot = None
        try:
            await check_maintenance(accounts)
            assert accounts.auth is not None and accounts.limiter is not None
            # Credits are checked live at admission (metered paths); an organization that ran
            # out can still list models and read its usage.
            principal = await accounts.auth.authenticate(self._authorization(scope), None, require_credits=False)
            if metered:
                # The organization's slot is held from here, while its body is read, until the
                # answer has ended: a tenant's slow or stalled bodies use up its own concurrency,
                # not the server's.
                slot = await accounts.limiter.acquire(principal.org_id, principal.concurrency_limit)
        except ApiError as error:
            await send_api_error(send, error, path)
            return
        except Exception as exc:  # the accounts database or Redis is down
            await send_api_error(send, accounts_unavailable(exc), path)
            return
        scope[PRINCIPAL_SCOPE_KEY] = principal
        scope[SLOT_SCOPE_KEY] = slot
        try:
            await self.app(scope, receive, send)
        finally:
            if slot is not None:
                with anyio.CancelScope(shield=True):
                    await slot.release()

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The WebSocket upgrade of /v1/responses: the key is checked on the handshake (401 as
        an HTTP answer, before the socket opens). No slot and no generation id here: a socket
        idles between turns, so the route takes both per ``response.create``."""
        from kiln.gateway.http.ws_upgrade import WEBSOCKET_PATHS, deny_upgrade

        if scope.get("path") not in WEBSOCKET_PATHS:
            await self.app(scope, receive, send)  # no such socket: the router refuses it
            return
        try:
            principal = await socket_principal(self.accounts, scope)
        except ApiError as error:
            await deny_upgrade(scope, receive, send, error)
            return
        scope[PRINCIPAL_SCOPE_KEY] = principal
        await self.app(scope, receive, send)

    @staticmethod
    def _authorization(scope: MutableMapping[str, Any]) -> str | None:
        for key, value in scope.get("headers", []):
            if key == b"authorization":
                return str(value.decode("latin-1"))
        for key, value in scope.get("headers", []):
            if key == b"x-api-key":  # Anthropic's SDKs and Claude Code send the key here
                return "Bearer " + str(value.decode("latin-1"))
        return None
