"""WebSocket mode of ``/v1/responses``: one long-lived socket per agent session.

The client sends each turn as a ``response.create`` text frame (the create body's fields at the
top level); the server answers with the same events the SSE stream carries, numbered per turn,
one JSON object per text frame. Turns run one at a time, in the order they arrived. A later turn
may send only its new input plus ``previous_response_id``: the connection's own state
(``connection_state.py``) resolves it first, also for ``store: false``, then the response store.

A refused turn gets an error frame, ``{"type": "error", "status", "error": {...}}``, and the
socket stays usable; only what ends the connection (its 60-minute lifetime, a client that floods
it) closes it. Each turn goes through the same lifecycle as an HTTP create (``ResponseRun``): in
hosted mode it is admitted, holds the organization's concurrency slot while it runs (not while
the socket idles) and is metered as one usage event with a generation id of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import time
import uuid
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from kiln.protocol.usage import Usage

from ...accounts.middleware import PRINCIPAL_SCOPE_KEY, socket_principal
from ...http.body import parse_json_bytes
from ...http.errors import ApiError, invalid
from ...http.sse import EventSequencer
from ...lifecycle.admission import admit
from ...lifecycle.generation import GenerationFailed, terminal_event
from ...lifecycle.response_object import ResponseObject
from ...lifecycle.run import ResponseRun
from ..create_request import CreateRequest
from ..framing import ResponseFramer, frames
from ..options import DoorOptions
from ..serving import session as door_session
from ..serving import validated as _validated
from .connection_state import ConnectionState

log = logging.getLogger("kiln.gateway.websocket")

PENDING_LIMIT = 32  # turns a client may queue behind the running one before it is cut off
# How long a warm-up (``generate: false``) may take before it is answered while its prefill goes
# on. Codex gives its start-of-session warm-up 15 s from the moment it opens the socket, then drops
# the socket and sends the turn on a new one without the warm-up; on a busy CPU the prefill of its
# ~1.3k-token prompt takes longer than that. The next turn on the socket waits for the prefill
# anyway (turns run in order), so it still finds the prompt cached.
WARM_UP_ANSWER_S = 5.0
_OPEN_KEY = "websockets_open"
_BY_ORG_KEY = "websockets_open_by_org"  # organization -> its sockets open (hosted mode)


def error_frame(error: ApiError) -> dict[str, Any]:
    """The WebSocket mode's error event: the HTTP status and the OpenAI error object."""
    return {"type": "error", "status": error.status, "error": {"type": error.type, "code": error.code, "message": error.message, "param": error.param}}


def connection_limit_reached(minutes: float) -> ApiError:
    return ApiError(400, f"Responses websocket connection limit reached ({minutes:g} minutes). Create a new websocket connection to continue.", code="websocket_connection_limit_reached")


def previous_not_found(previous_id: str) -> ApiError:
    return invalid(f"Previous response with id '{previous_id}' not found.", param="previous_response_id", code="previous_response_not_found")


async def _deny(ws: WebSocket, error: ApiError) -> None:
    """Refuse the upgrade with an HTTP answer (see ws_upgrade.py)."""
    await ws.receive()  # websocket.connect
    if "websocket.http.response" in (ws.scope.get("extensions") or {}):
        await ws.send_denial_response(error.response())
    else:
        await ws.close(1008, error.message[:120])


async def responses_socket(ws: WebSocket) -> None:
    """The upgrade of ``GET /v1/responses``: off switch, connection cap, then the session."""
    state = ws.app.state
    settings = state.settings
    if settings.websocket == "off":
        # 426 is the answer clients (Codex) treat as "use HTTP": they fall back at once.
        await _deny(ws, ApiError(426, "WebSocket mode is turned off on this server; use HTTP POST /v1/responses.", code="websocket_not_supported", type="invalid_request_error",
            headers={"Upgrade": "websocket"}))
        return
    open_now = getattr(state, _OPEN_KEY, 0)
    if settings.websocket_max_connections and open_now >= settings.websocket_max_connections:
        await _deny(ws, ApiError(503, "The server has as many WebSocket connections open as it allows; retry shortly or use HTTP.", code="server_is_overloaded", headers={"Retry-After": "1"}))
        return
    org = getattr(ws.scope.get(PRINCIPAL_SCOPE_KEY), "org_id", None)
    by_org: dict[Any, int] = getattr(state, _BY_ORG_KEY, None) or {}
    setattr(state, _BY_ORG_KEY, by_org)
    per_org = settings.websocket_max_connections_per_org
    if org is not None and per_org and by_org.get(org, 0) >= per_org:
        await _deny(ws, ApiError(429, f"Your organization has {per_org} WebSocket connections open, the most it may; close one or use HTTP.", code="rate_limit_exceeded"))
        return
    setattr(state, _OPEN_KEY, open_now + 1)
    if org is not None:
        by_org[org] = by_org.get(org, 0) + 1
    try:
        await Session(ws).run()
    finally:
        setattr(state, _OPEN_KEY, getattr(state, _OPEN_KEY, 1) - 1)
        if org is not None:
            by_org[org] -= 1
            if not by_org[org]:
                del by_org[org]


def _held(frame: str | bytes) -> int:
    """The memory a queued frame holds (a str of wide characters takes up to 4 bytes each)."""
    return len(frame) if isinstance(frame, bytes) else sys.getsizeof(frame)


class ClientGone(Exception):
    """The socket closed while a turn was running."""


class Session:
    """One accepted socket: a reader that queues frames, and the turns run in order."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.settings = ws.app.state.settings
        self.service = ws.app.state.responses
        self.id = uuid.uuid4().hex[:16]
        self.state = ConnectionState()
        self.inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self.gone = asyncio.Event()
        self.flooded = False
        # What the waiting frames hold, counted against the body budget: 32 frames of the largest
        # body each would otherwise be a gigabyte queued by one client.
        self.queued_bytes = 0
        self.overfull = False
        self.owner = getattr(ws.scope.get(PRINCIPAL_SCOPE_KEY), "org_id", None)
        self.turns = 0

    async def run(self) -> None:
        await self.ws.accept()
        started = time.monotonic()
        deadline = started + self.settings.websocket_max_age_s
        log.info("websocket opened", extra={"connection": self.id})
        reader = asyncio.ensure_future(self._read())
        try:
            while not self.gone.is_set():
                remaining = deadline - time.monotonic()
                try:
                    frame = await asyncio.wait_for(self.inbox.get(), max(remaining, 0)) if remaining > 0 else None
                except asyncio.TimeoutError:
                    frame = None
                if frame is not None:
                    self.queued_bytes -= _held(frame)
                if frame is None:
                    if self.gone.is_set():
                        break
                    if self.overfull:
                        limit = self.settings.max_body_bytes
                        await self._close_with(ApiError(413, f"More than {limit} bytes of response.create messages are waiting on this connection; send the next once a response has ended.",
                            code="request_too_large"), 1009)
                        break
                    if self.flooded:
                        await self._close_with(ApiError(400, f"More than {PENDING_LIMIT} response.create messages are waiting on this connection; send the next once a response has ended.",
                            code="too_many_pending_requests"), 1008)
                        break
                    await self._close_with(connection_limit_reached(self.settings.websocket_max_age_s / 60), 1000)
                    break
                await self._run_turn_task(frame)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            self.state.clear()  # nothing of a store:false turn outlives its connection
            log.info("websocket closed", extra={"connection": self.id, "turns": self.turns, "seconds": round(time.monotonic() - started, 1)})

    async def _read(self) -> None:
        """Queue the client's frames while a turn runs; notice the close at once."""
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""
                if self.inbox.qsize() >= PENDING_LIMIT:
                    self.flooded = True
                    self.inbox.put_nowait(None)
                    return
                if self.queued_bytes + _held(data) > self.settings.max_body_bytes and self.inbox.qsize():
                    self.overfull = True  # this frame is dropped; those waiting still run
                    self.inbox.put_nowait(None)
                    return
                self.queued_bytes += _held(data)
                self.inbox.put_nowait(data)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
        self.gone.set()
        self.inbox.put_nowait(None)

    async def _run_turn_task(self, frame: str | bytes) -> None:
        """One turn, cancelled if the client leaves meanwhile (its run then finishes as cut)."""
        turn = asyncio.ensure_future(self._turn(frame))
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({turn, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not turn.done():
                turn.cancel()
            await asyncio.gather(turn, return_exceptions=True)
        if turn.done() and not turn.cancelled() and turn.exception() is not None and not isinstance(turn.exception(), ClientGone):
            log.error("websocket turn failed", exc_info=turn.exception(), extra={"connection": self.id})
            self.gone.set()
            await self._close(1011)

    async def _send(self, event: dict[str, Any]) -> None:
        if self.gone.is_set():
            raise ClientGone()
        try:
            await self.ws.send_text(json.dumps(event, separators=(",", ":"), ensure_ascii=False))
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.gone.set()
            raise ClientGone() from None

    async def _close_with(self, error: ApiError, code: int) -> None:
        try:
            await self._send(error_frame(error))
        except ClientGone:
            return
        await self._close(code)

    async def _close(self, code: int) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:
            try:
                await self.ws.close(code)
            except (RuntimeError, OSError):
                pass

    # -- one turn --------------------------------------------------------------------------------
    def _request(self, frame: str | bytes) -> tuple[dict[str, Any], bool]:
        """The create body of a ``response.create`` frame and whether it generates."""
        raw_bytes = frame.encode("utf-8", "surrogatepass") if isinstance(frame, str) else frame
        limit = self.settings.max_body_bytes
        if len(raw_bytes) > limit:
            raise ApiError(413, f"The message is larger than the limit of {limit} bytes.", code="request_too_large")
        if not raw_bytes.strip():
            raise invalid("The message is empty; expected a JSON object.")
        raw = parse_json_bytes(raw_bytes)
        if not isinstance(raw, dict):
            raise invalid("The message must be a JSON object.")
        kind = raw.get("type")
        if kind != "response.create":
            raise invalid(f"Unsupported message type {kind!r}: this server accepts 'response.create'.", param="type",
                code="unsupported_event_type" if isinstance(kind, str) else "missing_required_parameter")
        body = {k: v for k, v in raw.items() if k not in ("type", "generate")}
        if body.get("background") not in (None, False):
            raise ApiError(400, "'background' is not supported in WebSocket mode.", code="unsupported_parameter", param="background")
        if body.get("stream") not in (None, True):
            raise ApiError(400, "'stream' is implicit in WebSocket mode: every response is streamed as events.", code="unsupported_parameter", param="stream")
        if body.get("stream_id") is not None:
            raise ApiError(400, "'stream_id' (multiplexed streams) is not supported by this server: open one socket per stream.", code="unsupported_parameter", param="stream_id")
        generate = raw.get("generate", True)
        if generate is None:
            generate = True
        if not isinstance(generate, bool):
            raise invalid("Invalid 'generate': expected a boolean.", param="generate")
        return {**body, "stream": True}, generate

    def _history(self, create: CreateRequest) -> list[dict[str, Any]] | None:
        """The connection's own history for ``previous_response_id``; None: ask the stores."""
        previous = create.previous_response_id
        if previous is None:
            return None
        history = self.state.history(previous)
        if history is not None:
            log.info("websocket continuation", extra={"connection": self.id, "previous_response_id": previous, "from": "connection"})
            return history
        store = self.service.stores.responses
        if store is None or not store.enabled:
            raise previous_not_found(previous)  # nothing else could hold it: resend full context
        log.info("websocket continuation", extra={"connection": self.id, "previous_response_id": previous, "from": "store"})
        return None

    async def _recheck(self) -> bool:
        """In hosted mode, what the upgrade checked, again before each turn: a revoked key (401)
        or maintenance (503) ends the socket with its error frame, as a refused upgrade would
        have; the organization's other state (credits, concurrency limit) comes fresh with the
        principal, for admission."""
        accounts = self.ws.app.state.accounts
        if accounts is None:
            return True
        try:
            # admission reads the principal from the scope: the fresh one is what it sees
            self.ws.scope[PRINCIPAL_SCOPE_KEY] = await socket_principal(accounts, self.ws.scope)
        except ApiError as error:
            await self._close_with(error, 1008 if error.status in (401, 403) else 1013)
            self.gone.set()
            return False
        return True

    async def _turn(self, frame: str | bytes) -> None:
        previous: str | None = None
        if not await self._recheck():
            return
        try:
            body, generate = self._request(frame)
            previous = body.get("previous_response_id") if isinstance(body.get("previous_response_id"), str) else None
            ticket = await admit(self.ws, body, turn=True)
        except ApiError as error:
            await self._refused(error, previous)
            return
        try:
            create = _validated(self.ws, body)
            # All turns go to the worker of the first; a warm-up (generate: false) prefills the
            # prompt into that worker's cache and its one token is dropped.
            options = DoorOptions(session=door_session(self.ws) or f"ws-{self.id}", warm_up=not generate)
            history = self._history(create)
            generation, own_input = await self.service.prepare(create, self.owner, history=history, options=options)
            run = ResponseRun(self.service, generation, own_input, ticket, streaming=True)
            opening = generation.response.snapshot()
            await run.start()
        except ApiError as error:
            await ticket.close()
            await self._refused(error, previous)
            return
        except BaseException:
            await ticket.close()
            raise
        self.turns += 1
        await self._stream(run, opening, warm_up=not generate, previous=previous)

    async def _refused(self, error: ApiError, previous: str | None) -> None:
        if previous is not None:
            self.state.forget(previous)  # a failed continuation evicts what it referenced
        await self._send(error_frame(error))

    async def _stream(self, run: ResponseRun, opening: dict[str, Any], *, warm_up: bool, previous: str | None) -> None:
        """The turn's events as frames, as the SSE door sends them (ResponseRun's contract)."""
        if warm_up:
            await self._warm_up(run, opening, previous)
            return
        response = run.response

        def keep_or_forget() -> None:  # the connection's state, before the client sees the end
            if response.status in ("completed", "incomplete"):
                self.state.remember(response.id, run.generation.request.input, response.data["output"])
            elif previous is not None:
                self.state.forget(previous)

        try:
            async for event in frames(run, ResponseFramer(opening, lambda: EventSequencer().stamp, finished=keep_or_forget)):
                await self._send(event)
            log.info("websocket turn", extra={"connection": self.id, "response_id": response.id, "status": response.status, "warm_up": False, "previous_response_id": previous})
        finally:
            await run.finish(client_gone=True)  # a no-op when the run finished above

    async def _warm_up(self, run: ResponseRun, opening: dict[str, Any], previous: str | None) -> None:
        """A ``generate: false`` turn: answered when its prefill is done, or after WARM_UP_ANSWER_S
        with the usage known so far while the prefill goes on. The turn holds the socket until the
        prefill is done, so the next turn (its continuation) starts on the cached prompt; the run is
        finished (stored, billed) then. A prefill that fails after the early answer keeps what the
        client was told: the warm-up stays on the socket (its input, no output), and its
        continuation is prefilled from there."""
        seq = EventSequencer()
        response = run.response
        await self._send(seq.stamp({"type": "response.created", "response": opening}))
        await self._send(seq.stamp({"type": "response.in_progress", "response": opening}))

        async def prefill() -> None:
            try:
                async for _ in run.events():
                    pass
            except GenerationFailed:
                pass  # the response is marked failed

        drain = asyncio.ensure_future(prefill())
        early = False
        try:
            await asyncio.wait({drain}, timeout=WARM_UP_ANSWER_S)
            if not drain.done():
                early = True
                self.state.remember(response.id, run.generation.request.input, [])
                await self._send(seq.stamp({"type": "response.completed", "response": early_warm_up(response, run.generation.delivered_usage)}))
                await drain
            as_warm_up(response)
            await run.finish()
            if response.status in ("completed", "incomplete"):
                self.state.remember(response.id, run.generation.request.input, response.data["output"])
            elif not early:
                self.state.forget(response.id)
                if previous is not None:
                    self.state.forget(previous)
            # Answered early, the client saw it completed: its state (the input, no output) stays,
            # and the continuation runs on a cold prompt instead of being told to resend.
            if not early:
                await self._send(seq.stamp(terminal_event(response)))
            log.info("websocket turn",
                extra={"connection": self.id, "response_id": response.id, "status": response.status, "warm_up": True, "answered_early": early, "previous_response_id": previous,
                    "error": response.data.get("error")})
        finally:
            if not drain.done():
                drain.cancel()
                await asyncio.gather(drain, return_exceptions=True)
            await run.finish(client_gone=True)  # a no-op when the run finished above


def early_warm_up(response: ResponseObject, so_far: Usage | None) -> dict[str, Any]:
    """The completed answer of a warm-up whose prefill is still running: no output, and the input
    usage the worker has reported so far (none before its first prefilled chunk)."""
    snap = response.snapshot()
    snap["status"] = "completed"
    snap["completed_at"] = int(time.time())
    snap["output"] = []
    if so_far is None:
        snap.pop("usage", None)
    else:
        snap["usage"] = dataclasses.replace(so_far, output_tokens=0, reasoning_tokens=0).to_map()
    return snap


def as_warm_up(response: Any) -> None:
    """A ``generate: false`` turn as OpenAI answers it: completed, no output, input usage only.

    The worker ran the prompt's prefill and one decode step (the token is dropped here), which
    leaves the prompt in its prefix cache for the next turn."""
    if response.status not in ("completed", "incomplete"):
        return
    usage = dict(response.data.get("usage") or {})
    inp = usage.get("input_tokens") or 0
    details = usage.get("input_tokens_details") or {"cached_tokens": 0}
    response.data["output"] = []
    response.finish("completed", {"input_tokens": inp, "input_tokens_details": details, "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inp})
