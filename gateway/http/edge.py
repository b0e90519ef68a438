"""The HTTP edge: checks every request passes before any route or the accounts layer sees it.

One pure ASGI middleware, outermost in the app, because these defences must hold for every route
and must cost the gateway nothing when they refuse:

1. **Host** (defeats DNS rebinding). In local mode on a loopback address, only loopback names
   (``localhost``, ``127.x.y.z``, ``[::1]``, any port) may appear in ``Host``: a web page whose
   name was rebound to 127.0.0.1 still sends its own name and gets 403. ``--allowed-hosts`` adds
   names (``*``: any). On a non-loopback bind, and in hosted mode (a load balancer fronts it), any
   Host is accepted unless ``--allowed-hosts`` is set. ``/health`` always accepts an IP-literal
   Host so probes that address the pod by IP keep working (a rebinding page sends a name).
2. **Origin** (local mode). A request carrying ``Origin`` is refused (403) unless the origin is on
   a loopback host or in ``--cors-origins``. Hosted mode does not refuse (API keys authenticate),
   but in both modes CORS preflights are answered, and ``Access-Control-Allow-Origin`` added, only
   for configured origins.
3. **Content-Type**: a POST/PUT/PATCH that has a body, or names a type, must be
   ``application/json`` (else 415). That closes the CORS "simple request" hole: a page may POST
   ``text/plain`` or a form cross-site without a preflight, but never JSON.
4. **Bounds**: a declared ``Content-Length`` over ``--max-body-bytes`` is 413 before a byte is
   read; at most ``--max-connections`` requests are served at once (beyond: 503 + Retry-After at
   once, no queue); a body must finish arriving within ``--body-timeout`` seconds of the request's
   start (else 408 ``request_timeout`` and the connection is closed). The body bound wraps
   ``receive``, so it holds whoever reads the body (a route or the accounts middleware). And the
   bytes of bodies still arriving, summed over all requests, stay under ``--body-buffer-bytes``: a
   chunk past it gets 503 + Retry-After, so many clients that send most of a large body and stall
   cannot make the gateway hold gigabytes until their deadlines.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.protocol.security import is_loopback_host

from .errors import ApiError

OPEN_PATH = "/health"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
# Request headers a browser client (the OpenAI JS SDK included) may send cross-origin.
CORS_HEADERS = frozenset({"authorization", "content-type", "accept", "idempotency-key", "openai-organization", "openai-project", "openai-beta"})
CORS_HEADER_PREFIXES = ("x-stainless-", "openai-")
CORS_EXPOSE = "retry-after, x-kiln-generation-id, x-neocloud-generation-id"
CORS_MAX_AGE = "600"


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The name part of a ``Host`` header: without its port, lower-cased, brackets kept off."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    name, sep, port = value.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        value = name
    return value.rstrip(".")


def normalize_origin(value: str) -> str | None:
    """``scheme://host[:port]`` lower-cased, or None for an opaque or malformed origin ("null")."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


@dataclass(frozen=True)
class EdgePolicy:
    """What the edge enforces, decided once from the settings."""

    local: bool  # auth "none": refuse foreign origins
    allowed_hosts: frozenset[str] | None  # None: any Host; else these names besides loopback ones
    cors_any: bool
    cors_origins: frozenset[str]
    max_body_bytes: int
    max_connections: int  # 0: no cap
    body_timeout_s: float  # 0: no bound
    body_buffer_bytes: int  # 0: no bound

    @classmethod
    def from_settings(cls, settings: Any) -> EdgePolicy:
        configured = getattr(settings, "allowed_hosts", None)
        local = settings.auth == "none"
        if configured is not None:
            hosts = None if "*" in configured else frozenset(host_name(h) for h in configured)
        elif local and is_loopback_host(settings.host):
            hosts = frozenset()
        else:
            hosts = None  # public bind or hosted mode: the network in front decides names
        origins = getattr(settings, "cors_origins", None) or ()
        return cls(
            local=local,
            allowed_hosts=hosts,
            cors_any="*" in origins,
            cors_origins=frozenset(o for o in (normalize_origin(x) for x in origins if x != "*") if o),
            max_body_bytes=settings.max_body_bytes,
            max_connections=getattr(settings, "max_connections", 0) or 0,
            body_timeout_s=getattr(settings, "body_timeout_s", 0.0) or 0.0,
            body_buffer_bytes=getattr(settings, "body_buffer_bytes", 0) or 0,
        )

    def host_allowed(self, host: str | None, path: str) -> bool:
        if self.allowed_hosts is None or host is None:  # no Host at all: not a browser
            return True
        name = host_name(host)
        if is_loopback_host(name) or name in self.allowed_hosts:
            return True
        return path == OPEN_PATH and _is_ip_literal(name)

    def cors_allowed(self, origin: str | None) -> bool:
        """A configured origin: it gets preflights answered and Access-Control-Allow-Origin."""
        if origin is None:
            return False
        normalized = normalize_origin(origin)
        return normalized is not None and (self.cors_any or normalized in self.cors_origins)

    def origin_allowed(self, origin: str | None) -> bool:
        if origin is None or not self.local:
            return True
        normalized = normalize_origin(origin)
        if normalized is not None and is_loopback_host(urlsplit(normalized).hostname or ""):
            return True
        return self.cors_allowed(origin)


class _Budget:
    """Bytes of request bodies received but not yet complete, over all requests in flight."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


def _busy(message: str) -> ApiError:
    return ApiError(503, message, code="server_is_overloaded", headers={"Retry-After": "1", "Connection": "close"})


class BodyTimeout(ApiError):
    """The request body did not finish arriving in time."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            408,
            f"The request body did not arrive within {seconds:g} seconds.",
            code="request_timeout",
            type="invalid_request_error",
            headers={"Connection": "close"},
        )


def _headers(scope: Scope) -> dict[str, str]:
    """The request headers by lower-case name (the last one wins; browsers send each once)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _has_body(headers: dict[str, str]) -> bool:
    length = headers.get("content-length", "").strip()
    return "transfer-encoding" in headers or (length != "" and length != "0")


def _is_json(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


class _Exchange:
    """One request's ``receive`` with the body deadline and buffer budget, and ``send`` with the
    CORS headers. ``failure`` is the error ``receive`` raised, answered by whoever reads the body
    (a route's ApiError handler, the accounts middleware) or else by the edge itself."""

    def __init__(self, receive: Receive, send: Send, timeout_s: float, budget: _Budget, cors_origin: str | None, has_body: bool) -> None:
        self._receive = receive
        self._send = send
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        self._budget = budget
        self._held = 0
        self._cors_origin = cors_origin
        self.body_done = not has_body
        self.failure: ApiError | None = None
        self.started = False
        self._drainer: asyncio.Task[None] | None = None

    async def receive(self) -> Message:
        if self.body_done:
            return await self._receive()
        if self._deadline is None:
            message = await self._receive()
        else:
            remaining = self._deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(self._receive(), remaining)
            except asyncio.TimeoutError:
                self.release()
                self.failure = BodyTimeout(self._timeout_s)
                raise self.failure from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_done = True
            self.release()
        elif self._budget.limit:
            size = len(message.get("body", b""))
            if self._budget.used + size > self._budget.limit:
                self.release()
                self.failure = _busy("The server is receiving too many large request bodies at once; retry shortly.")
                raise self.failure
            self._budget.used += size
            self._held += size
        return message

    async def drain(self) -> None:
        """Discard what is left of a body the answer did not need, until the body deadline.

        Hypercorn queues a few body chunks for the app and, once its queue is full, stops reading
        the socket; after an early answer (403, 413, 415, 503) nobody empties that queue, and the
        connection would then stay open for as long as the client cares to keep it. Reading the
        rest (concurrently with the final send, which is where Hypercorn blocks) lets it close as
        soon as the client has sent its body."""
        while not self.body_done and self._deadline is not None:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                message = await asyncio.wait_for(self._receive(), remaining)
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                self.body_done = True

    def release(self) -> None:
        """Give this request's share of the body budget back (idempotent)."""
        self._budget.used -= self._held
        self._held = 0

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = list(message.get("headers", []))
            if self._cors_origin is not None:
                headers += _cors_response_headers(self._cors_origin)
            # An answer that starts before the body has arrived (a 401 from the accounts
            # middleware, the edge's own refusals) ends the connection: Hypercorn closes it
            # anyway when the request's body is not in by the time the app returns, and a client
            # told nothing may already be sending its next request on it ("Server disconnected
            # without sending a response"; a CI run of test_401_before_anything saw it).
            if (self.failure is not None or not self.body_done) and not any(k.lower() == b"connection" for k, _ in headers):
                headers.append((b"connection", b"close"))
            message = {**message, "headers": headers}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            if not self.body_done and self._drainer is None and not isinstance(self.failure, BodyTimeout):
                self.release()
                self._drainer = asyncio.ensure_future(self.drain())
        await self._send(message)

    async def finish(self) -> None:
        """The request is over: stop draining and give the body budget back."""
        if self._drainer is not None:
            self._drainer.cancel()
            await asyncio.gather(self._drainer, return_exceptions=True)
        self.release()


def _cors_response_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"access-control-expose-headers", CORS_EXPOSE.encode()), (b"vary", b"Origin")]


class EdgeMiddleware:
    """Host, Origin and Content-Type checks, CORS, and the body/concurrency bounds (module doc)."""

    def __init__(self, app: ASGIApp, settings: Any) -> None:
        self.app = app
        self.policy = EdgePolicy.from_settings(settings)
        self.in_flight = 0
        self.body_budget = _Budget(self.policy.body_buffer_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.policy
        headers = _headers(scope)
        path = scope.get("path", "")
        method = scope.get("method", "GET").upper()
        origin = headers.get("origin")
        cors_origin = origin if policy.cors_allowed(origin) else None
        exchange = _Exchange(receive, send, policy.body_timeout_s, self.body_budget, cors_origin, _has_body(headers))

        refusal = self._refusal(headers, path, method, origin)
        if refusal is not None:
            await self._reply(refusal, scope, receive, exchange.send)
            await exchange.finish()
            return
        if method == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            await self._preflight(scope, receive, exchange.send, headers)
            return
        counted = path != OPEN_PATH and policy.max_connections > 0
        if counted and self.in_flight >= policy.max_connections:
            await self._reply(_busy("The server is at its limit of concurrent requests; retry shortly."), scope, receive, exchange.send)
            await exchange.finish()
            return
        if counted:
            self.in_flight += 1
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception:
            if exchange.failure is None:
                raise
            # The body deadline or budget fired inside a reader that let it through: answer here.
            if not exchange.started:
                await self._reply(exchange.failure, scope, receive, exchange.send)
        finally:
            await exchange.finish()
            if counted:
                self.in_flight -= 1

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket upgrade passes the same Host and Origin rules as a request (a page's
        script may open a socket to localhost cross-origin; browsers send its Origin), refused
        with a 403 HTTP answer. Frame size and connection bounds are the socket route's."""
        from .ws_upgrade import deny_upgrade

        headers = _headers(scope)
        path = scope.get("path", "")
        refusal = self._refusal(headers, path, "GET", headers.get("origin"))
        if refusal is not None:
            await deny_upgrade(scope, receive, send, refusal)
            return
        await self.app(scope, receive, send)

    def _refusal(self, headers: dict[str, str], path: str, method: str, origin: str | None) -> ApiError | None:
        policy = self.policy
        if not policy.host_allowed(headers.get("host"), path):
            return ApiError(403, "This server answers only requests addressed to a loopback name (localhost, 127.0.0.1, [::1]); start it with --allowed-hosts to accept other names.",
                code="host_not_allowed")
        if not policy.origin_allowed(origin):
            return ApiError(403, "Requests from web pages at this origin are refused; start the server with --cors-origins to allow it.", code="origin_not_allowed")
        if method == "OPTIONS" and origin is not None and "access-control-request-method" in headers and not policy.cors_allowed(origin):
            return ApiError(403, "Cross-origin requests from this origin are not allowed; start the server with --cors-origins to allow it.", code="origin_not_allowed")
        if method in BODY_METHODS:
            content_type = headers.get("content-type")
            if (content_type is not None and not _is_json(content_type)) or (content_type is None and _has_body(headers)):
                return ApiError(415, "Request bodies must be JSON, sent with Content-Type: application/json.", code="unsupported_media_type", type="invalid_request_error")
        length = headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > policy.max_body_bytes:
            return ApiError(413, f"The request body is larger than the limit of {policy.max_body_bytes} bytes.", code="request_too_large", headers={"Connection": "close"})
        return None

    async def _preflight(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]) -> None:
        requested = [h.strip().lower() for h in headers.get("access-control-request-headers", "").split(",") if h.strip()]
        allowed = sorted(CORS_HEADERS | {h for h in requested if h.startswith(CORS_HEADER_PREFIXES)})
        response = Response(
            status_code=204,
            headers={
                "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": ", ".join(allowed),
                "Access-Control-Max-Age": CORS_MAX_AGE,
            },
        )
        await response(scope, receive, send)  # the exchange's send adds Allow-Origin and Vary

    @staticmethod
    async def _reply(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
        await error.response()(scope, receive, send)
