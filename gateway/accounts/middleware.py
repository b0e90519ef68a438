"""The hosted request path: a pure ASGI middleware in front of the Starlette routes.

Active when the gateway runs with ``--auth keys``. For every API path (all but ``/health`` and
``/admin/...``) it answers 503 during maintenance and authenticates ``Authorization: Bearer``
(401) before anything else runs. For ``POST /v1/responses`` (and the ``/responses`` alias) it also:

1. mints a generation id and puts it in ``X-Neocloud-Generation-Id`` and ``X-Kiln-Generation-Id``
   on every response of the request, streamed ones included;
2. reads the body (bounded, 413) to learn ``model`` and replays it to the app unchanged; checks the
   key (401/403), the catalog (404 ``model_not_found``), the credits (402) and that a worker serves
   the model (503 + Retry-After) -- all before a worker is involved;
3. takes one of the organization's concurrency slots (429 ``rate_limit_exceeded``, no rate-limit
   headers) and gives it back however the request ends: completion, failure, exception,
   cancellation or client disconnect;
4. meters: a non-streaming 200 is recorded (and debited) before its body leaves, with
   ``usage.cost`` added to the body; a stream is forwarded unchanged while its frames are parsed,
   and the usage of its last event is recorded before that event is forwarded (``completed`` and
   ``incomplete`` are billed, ``failed`` and ``error`` recorded at cost 0). Other outcomes (HTTP
   errors, disconnects, streams cut short) are recorded at cost 0. One ledger row per request that
   got past the slot; refusals before it (401-429, 503) leave none.
5. turns the app's 500/502 answers (the model backend failed or could not be reached) into the
   contract's 502 with a plain-text body.

Recording before the final bytes are sent means a client that saw a completed response is always in
the ledger, even if the gateway dies right after; a request in flight when the gateway dies is not
billed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable

from kiln.gateway.errors import ApiError

from .auth import Principal
from .metering import UsageRecord, new_generation_id
from .service import Accounts

log = logging.getLogger("kiln.gateway.accounts")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Create and compact generate tokens; both are metered (compaction bills its summary's usage).
METERED_PATHS = frozenset({"/v1/responses", "/responses", "/v1/responses/compact", "/responses/compact"})
OPEN_PATHS = frozenset({"/health"})
GENERATION_HEADERS = (b"x-neocloud-generation-id", b"x-kiln-generation-id")
BILLED_EVENTS = frozenset({"response.completed", "response.incomplete"})
UNBILLED_EVENTS = frozenset({"response.failed", "error"})
PRINCIPAL_SCOPE_KEY = "kiln.principal"
GENERATION_SCOPE_KEY = "kiln.generation_id"


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


def _json_bytes(obj: Any) -> bytes:
    # The same encoding as Starlette's JSONResponse.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


async def send_api_error(send: Send, error: ApiError) -> None:
    body = _json_bytes(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_text(send: Send, status: int, text: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = text.encode()
    base = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": base + list(headers)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def maintenance_error(accounts: Accounts) -> ApiError:
    seconds = accounts.maintenance_retry_after
    return ApiError(
        503,
        f"The API is down for maintenance. Retry after {seconds} seconds.",
        headers={"Retry-After": str(seconds)},
    )


def accounts_unavailable(exc: BaseException) -> ApiError:
    log.error("accounts backend unavailable: %s", exc, exc_info=exc)
    return ApiError(503, "The service is temporarily unavailable. Retry with exponential backoff.", headers={"Retry-After": "5"})


def _int(value: Any) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def _usage_counts(usage: Any) -> tuple[int, int, int]:
    """(input, cached, output) tokens from a Responses ``usage`` object (zeros when absent)."""
    if not isinstance(usage, dict):
        return 0, 0, 0
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return _int(usage.get("input_tokens")), _int(cached), _int(usage.get("output_tokens"))


class _Replay:
    """The ``receive`` the app sees: the body already read, then a disconnect when the client goes.

    The middleware owns the real ``receive`` (``listen`` drains it), so that it learns about a
    disconnect even while the app is not listening (a non-streaming request)."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body = body
        self._replayed = False
        self._receive = receive
        self.disconnected = asyncio.Event()

    async def listen(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return

    async def __call__(self) -> Message:
        if not self._replayed:
            self._replayed = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self.disconnected.wait()
        return {"type": "http.disconnect"}


class _SseParser:
    """Splits an SSE byte stream into (event type, data) frames without changing the bytes sent."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[tuple[str, dict | None]]:
        """The interesting frames completed by ``chunk``: terminal events with their parsed data."""
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        self._buffer += chunk
        found: list[tuple[str, dict | None]] = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                return found
            frame, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            name, data = None, []
            for line in frame.split(b"\n"):
                if line.startswith(b"event:"):
                    name = line[6:].strip().decode("utf-8", "replace")
                elif line.startswith(b"data:"):
                    data.append(line[5:].lstrip(b" "))
            if name is not None and name not in BILLED_EVENTS and name not in UNBILLED_EVENTS:
                continue
            try:
                payload = json.loads(b"\n".join(data)) if data else None
            except ValueError:
                payload = None
            if name is None and isinstance(payload, dict):
                name = payload.get("type")
            if name in BILLED_EVENTS or name in UNBILLED_EVENTS:
                found.append((name, payload if isinstance(payload, dict) else None))


class _Tap:
    """The ``send`` the app sees on a metered request: adds the generation headers, meters the
    answer, converts backend failures to the plain-text 502."""

    def __init__(self, accounts: Accounts, send: Send, record: UsageRecord, started_at: float) -> None:
        self._accounts = accounts
        self._send = send
        self._base = record  # status and counts are filled in when the outcome is known
        self._started_at = started_at
        self.started = False  # the app has begun its answer
        self.recorded = False
        self._mode = ""
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._sse = _SseParser()
        self._unbilled: tuple[str, dict | None] | None = None
        self._pending: asyncio.Future | None = None

    async def record(self, status: str, usage: Any = None) -> Any:
        if self.recorded:
            return None
        self.recorded = True
        inp, cached, out = _usage_counts(usage)
        record = UsageRecord(
            generation_id=self._base.generation_id,
            org_id=self._base.org_id,
            key_prefix=self._base.key_prefix,
            model=self._base.model,
            status=status,
            input_tokens=inp,
            cached_tokens=cached,
            output_tokens=out,
            latency_ms=int((time.monotonic() - self._started_at) * 1000),
        )
        # Shielded: if the client leaves while the row is being written, the write still finishes
        # (the stream's task is cancelled, not the ledger).
        self._pending = asyncio.ensure_future(self._write(record))
        return await asyncio.shield(self._pending)

    async def _write(self, record: UsageRecord) -> Any:
        try:
            return await self._accounts.record(record)
        except Exception:
            log.exception("usage event not recorded", extra={"generation_id": record.generation_id})
            return None

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.started = True
            self._status = message["status"]
            self._headers = list(message.get("headers", []))
            content_type = b""
            for key, value in self._headers:
                if key.lower() == b"content-type":
                    content_type = value.lower()
            if self._status in (500, 502):
                self._mode = "bad_gateway"
            elif self._status == 200 and content_type.startswith(b"text/event-stream"):
                self._mode = "sse"
                await self._send(message)
            elif self._status == 200 and content_type.startswith(b"application/json"):
                self._mode = "json"
            else:
                self._mode = "pass"
                await self._send(message)
            return
        if kind != "http.response.body":
            await self._send(message)
            return
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if self._mode in ("json", "bad_gateway"):
            self._chunks.append(chunk)
            if not more:
                await (self._finish_json() if self._mode == "json" else self._finish_bad_gateway())
            return
        if self._mode == "sse" and chunk:
            for name, payload in self._sse.feed(chunk):
                response = payload.get("response") if payload else None
                usage = response.get("usage") if isinstance(response, dict) else None
                if name in BILLED_EVENTS or name == "response.failed":
                    # Before the last event leaves: a client that saw it is in the ledger.
                    await self.record(name.removeprefix("response."), usage)
                elif self._unbilled is None:  # an ``error`` event; a response.failed may follow
                    self._unbilled = (name, usage)
        await self._send(message)

    async def _finish_json(self) -> None:
        raw = b"".join(self._chunks)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        usage = body.get("usage") if isinstance(body, dict) else None
        status = body.get("status") if isinstance(body, dict) else None
        if status is None and isinstance(body, dict) and body.get("object") == "response.compaction":
            status = "completed"
        if status in ("completed", "incomplete") and isinstance(usage, dict):
            event = await self.record(status, usage)
            if event is not None:
                usage["cost"] = float(event.cost_usd)
                raw = _json_bytes(body)
        else:
            log.warning("200 response without final usage; recorded unbilled",
                        extra={"generation_id": self._base.generation_id, "status": status})
            await self.record("failed", usage)
        headers = [(k, v) for k, v in self._headers if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        await self._send({"type": "http.response.start", "status": self._status, "headers": headers})
        await self._send({"type": "http.response.body", "body": raw, "more_body": False})

    async def _finish_bad_gateway(self) -> None:
        message = "The model backend returned an error or could not be reached."
        try:
            message = json.loads(b"".join(self._chunks))["error"]["message"] or message
        except (ValueError, KeyError, TypeError):
            pass
        await self.record("error")
        await send_text(self._send, 502, f"Bad Gateway: {message}\n")

    async def finish(self, exception: BaseException | None = None) -> None:
        """Record what was not recorded yet; called once the app is done, however it ended."""
        if self.recorded:
            if self._pending is not None and not self._pending.done():
                await asyncio.wait({self._pending})
            return
        if self._mode == "sse":
            if self._unbilled is not None:
                await self.record("failed" if self._unbilled[0] == "response.failed" else "error", self._unbilled[1])
            else:  # the client left, or the stream was cut: nothing billed
                await self.record("failed")
        elif exception is not None or (self._mode == "pass" and self._status >= 400):
            await self.record("error")
        else:  # cancelled before any answer (client disconnect)
            await self.record("failed")


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped


class AccountsMiddleware:
    """Pure ASGI, so that it can read and replay the request body and tap streamed bodies."""

    def __init__(self, app, accounts: Accounts) -> None:
        self.app = app
        self.accounts = accounts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in OPEN_PATHS or path == "/admin" or path.startswith("/admin/"):
            await self.app(scope, receive, send)
        elif scope["method"] == "POST" and path in METERED_PATHS:
            await self._metered(scope, receive, send)
        else:
            await self._authenticated(scope, receive, send)

    @staticmethod
    def _authorization(scope: Scope) -> str | None:
        for key, value in scope.get("headers", []):
            if key == b"authorization":
                return value.decode("latin-1")
        return None

    async def _authenticated(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Any other API route: maintenance, then the key (credits not required: an organization
        that ran out can still list models and read its usage)."""
        accounts = self.accounts
        try:
            if accounts.maintenance:
                raise maintenance_error(accounts)
            principal = await accounts.auth.authenticate(self._authorization(scope), None, require_credits=False)
        except ApiError as error:
            await send_api_error(send, error)
            return
        except Exception as exc:  # the accounts database or Redis is down
            await send_api_error(send, accounts_unavailable(exc))
            return
        scope[PRINCIPAL_SCOPE_KEY] = principal
        await self.app(scope, receive, send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.accounts.max_body_bytes
        too_large = ApiError(413, f"The request body is larger than the limit of {limit} bytes.", code="request_too_large")
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > limit:
                raise too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _admit(self, scope: Scope, body: bytes) -> tuple[Principal, str]:
        """Every check before a worker is involved; returns the caller and the requested model."""
        accounts = self.accounts
        header = self._authorization(scope)
        try:
            parsed = json.loads(body) if body.strip() else None
        except (ValueError, UnicodeDecodeError):
            parsed = None
        model = parsed.get("model") if isinstance(parsed, dict) else None
        if not isinstance(model, str) or not model:
            # Malformed: the app answers 400 once the caller is known to be a customer.
            return await accounts.auth.authenticate(header, None), ""
        await accounts.auth.authenticate(header, None, require_credits=False)  # 401 first
        if parsed.get("background") not in (None, False):
            # A background job outlives this HTTP exchange, so the tap could not meter it.
            raise ApiError(
                400,
                "'background' is not supported on this gateway: send the request in the foreground.",
                code="unsupported_parameter",
                param="background",
            )
        if accounts.catalog is not None:
            accounts.catalog.require(model)  # 404 model_not_found
        principal = await accounts.auth.authenticate(header, model)  # 403, 402 (cached lookup)
        pool = getattr(getattr(scope.get("app"), "state", None), "pool", None)
        if accounts.catalog is not None and pool is not None and pool.resolve(model) is None:
            raise ApiError(
                503,
                f"No model backend is serving '{model}' right now. Retry with exponential backoff.",
                headers={"Retry-After": "1"},
            )
        return principal, model

    async def _metered(self, scope: Scope, receive: Receive, send: Send) -> None:
        accounts = self.accounts
        started_at = time.monotonic()
        generation_id = new_generation_id()
        scope[GENERATION_SCOPE_KEY] = generation_id
        send = _with_headers(send, [(name, generation_id.encode()) for name in GENERATION_HEADERS])
        try:
            if accounts.maintenance:
                raise maintenance_error(accounts)
            body = await self._read_body(scope, receive)
            principal, model = await self._admit(scope, body)
            slot = await accounts.limiter.acquire(principal.org_id, principal.concurrency_limit)
        except _ClientGone:
            return
        except ApiError as error:
            await send_api_error(send, error)
            return
        except Exception as exc:  # the accounts database or Redis is down
            await send_api_error(send, accounts_unavailable(exc))
            return
        scope[PRINCIPAL_SCOPE_KEY] = principal
        tap = _Tap(
            accounts,
            send,
            UsageRecord(generation_id, principal.org_id, principal.key_prefix, model, "error"),
            started_at,
        )
        replay = _Replay(body, receive)
        listener = asyncio.create_task(replay.listen())
        gone = asyncio.create_task(replay.disconnected.wait())
        app_task = asyncio.create_task(self.app(scope, replay, tap))
        failure: BaseException | None = None
        try:
            await asyncio.wait({app_task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not app_task.done() and not tap.started:
                # A non-streaming request whose client left: stop the generation (the route's
                # cleanup tells the worker) instead of holding the slot until it would have ended.
                app_task.cancel()
            await asyncio.wait({app_task})
            if not app_task.cancelled() and app_task.exception() is not None:
                failure = app_task.exception()
                log.error("request failed", exc_info=failure, extra={"generation_id": generation_id})
                if not tap.started:
                    await send_text(send, 500, "Internal Server Error\n")
        finally:
            for task in (gone, listener, app_task):
                if not task.done():
                    task.cancel()
            if not app_task.done():
                await asyncio.wait({app_task})
            try:
                await slot.release()
            finally:
                await tap.finish(failure)
