"""The pool of connected workers: registration, liveness, routing and per-request channels.

The gateway binds one ROUTER socket; each worker connects a DEALER and registers. Messages for a
request are delivered to that request's ``Channel``. A worker that stops heartbeating is dropped
and every request it held gets a ``Failed`` so that no client waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kiln.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Compacted,
    Done,
    Event,
    Failed,
    Heartbeat,
    ProtocolError,
    Register,
    Registered,
    TokenCount,
    decode,
    encode,
)

from .errors import ApiError

log = logging.getLogger("kiln.gateway.workers")

# A request's channel holds at most this many undelivered messages. A worker emits a handful of
# events per token, so this is far above what a client that keeps reading ever accumulates.
CHANNEL_LIMIT = 65536
# Model names remembered for ``WorkerPool.require`` (oldest forgotten first), and the Retry-After
# seconds of its 503 while a known model has no live worker.
KNOWN_MODELS_LIMIT = 1024
RETRY_AFTER_S = 2


@dataclass
class WorkerHandle:
    identity: bytes
    info: Register
    last_seen: float
    active: int = 0
    queued: int = 0
    cache: dict[str, Any] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)
    routed: int = 0  # requests sent to this worker since it registered (for /metrics)

    @property
    def names(self) -> set[str]:
        return {self.info.model, *self.info.aliases}

    @property
    def load(self) -> int:
        # Our own in-flight count is current; the heartbeat's figures lag by up to a second.
        return max(len(self.inflight), self.active + self.queued)

    def overloaded(self) -> bool:
        return self.load >= self.info.capacity + self.info.queue_depth


class Channel:
    """Messages of one request, in the order the worker sent them."""

    def __init__(self, req_id: str, worker: WorkerHandle) -> None:
        self.req_id = req_id
        self.worker = worker
        self.queue: asyncio.Queue[Any] = asyncio.Queue(CHANNEL_LIMIT)
        self.finished = False

    def put(self, message: Any) -> None:
        if self.finished:
            return
        if isinstance(message, (Done, Failed, TokenCount, Compacted)):
            self.finished = True
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.finished = True
            self.queue = asyncio.Queue(1)
            self.queue.put_nowait(
                Failed(self.req_id, 502, "server_error", "client fell too far behind the stream")
            )

    async def get(self) -> Any:
        return await self.queue.get()


# Where the route keeps a session header's value for requests without a prompt_cache_key.
SESSION_FIELD = "kiln_session"
SESSION_HEADERS = ("session-id", "session_id", "x-session-id")


def routing_key(body: dict[str, Any]) -> str | None:
    """What keeps a conversation on one worker: ``prompt_cache_key``, else a session header
    (Codex sends ``session-id`` on every turn of a session)."""
    return body.get("prompt_cache_key") or body.get(SESSION_FIELD)


class NoWorker(Exception):
    """No registered worker serves the model (or all that do are full)."""


class WorkerPool:
    def __init__(self, bind: str, *, heartbeat_timeout_s: float = 5.0) -> None:
        self.bind = bind
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.workers: dict[bytes, WorkerHandle] = {}
        self.channels: dict[str, Channel] = {}
        # prompt_cache_key -> worker identity that last served it (bounded LRU).
        self._sticky: dict[str, bytes] = {}
        self._sticky_limit = 65536
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._registered = asyncio.Event()
        # Every name (id or alias) a worker has registered -> its model id, kept after the worker
        # goes, so that a model whose worker is restarting answers 503 (retry) instead of 404.
        self._known: dict[str, str] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker may reuse its identity
        sock.bind(self.bind)
        self._sock = sock
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="kiln-pool-recv"),
            asyncio.create_task(self._liveness_loop(), name="kiln-pool-liveness"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    # -- catalogue -------------------------------------------------------------------------------
    def models(self) -> list[Register]:
        seen: dict[str, Register] = {}
        for w in self.workers.values():
            seen.setdefault(w.info.model, w.info)
        return list(seen.values())

    def resolve(self, name: str) -> str | None:
        """The served model id for ``name`` (an id or an alias), or None."""
        for w in self.workers.values():
            if name in w.names:
                return w.info.model
        return None

    def known(self, name: str) -> bool:
        """Whether ``name`` was served by some worker since the gateway started (bounded memory)."""
        return name in self._known

    def require(self, name: str) -> str:
        """The served model id for ``name``; else 503 while it is known but has no live worker
        (a worker restarting), else 404 ``model_not_found``."""
        model = self.resolve(name)
        if model is not None:
            return model
        if self.known(name):
            raise ApiError(
                503,
                f"No worker is serving model '{name}' right now; retry shortly.",
                code="server_is_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        raise ApiError(404, f"The model '{name}' does not exist or is not served here.", code="model_not_found", param="model")

    def _remember(self, info: Register) -> None:
        for name in (info.model, *info.aliases):
            self._known.pop(name, None)
            self._known[name] = info.model
        while len(self._known) > KNOWN_MODELS_LIMIT:
            self._known.pop(next(iter(self._known)))

    def context_window(self, model: str) -> int | None:
        for w in self.workers.values():
            if model in w.names:
                return w.info.context_window
        return None

    # -- routing ---------------------------------------------------------------------------------
    def pick(self, model: str, cache_key: str | None = None) -> WorkerHandle:
        """Choose a worker for ``model``.

        Requests sharing a ``cache_key`` go back to the worker that holds their prefix unless it is
        overloaded; everything else goes to the least-loaded worker.
        """
        candidates = [w for w in self.workers.values() if model in w.names]
        if not candidates:
            raise NoWorker(model)
        if cache_key is not None:
            identity = self._sticky.get(cache_key)
            sticky = self.workers.get(identity) if identity is not None else None
            if sticky is not None and model in sticky.names and not sticky.overloaded():
                return sticky
        chosen = min(candidates, key=lambda w: (w.load / max(w.info.capacity, 1), w.load))
        if cache_key is not None:
            self._sticky.pop(cache_key, None)
            self._sticky[cache_key] = chosen.identity
            if len(self._sticky) > self._sticky_limit:
                self._sticky.pop(next(iter(self._sticky)))
        return chosen

    async def wait_for_worker(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._registered.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # -- requests --------------------------------------------------------------------------------
    async def open(self, worker: WorkerHandle, req_id: str, message: Any) -> Channel:
        channel = Channel(req_id, worker)
        self.channels[req_id] = channel
        worker.inflight.add(req_id)
        worker.routed += 1
        await self._send(worker.identity, message)
        return channel

    def close(self, channel: Channel, *, cancel: bool) -> None:
        """Forget a request; tell its worker to stop if it has not finished."""
        self.channels.pop(channel.req_id, None)
        channel.worker.inflight.discard(channel.req_id)
        if cancel and not channel.finished and channel.worker.identity in self.workers:
            channel.finished = True
            # Scheduled as its own task: close() runs in cleanup paths that may be cancelled.
            asyncio.get_running_loop().create_task(
                self._send(channel.worker.identity, Cancel(channel.req_id))
            )

    # -- internals -------------------------------------------------------------------------------
    async def _send(self, identity: bytes, message: Any) -> None:
        assert self._sock is not None
        await self._sock.send_multipart([identity, encode(message)])

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                continue
            identity, payload = frames
            try:
                message = decode(payload)
            except ProtocolError as exc:
                log.warning("dropped frame from %r: %s", identity, exc)
                continue
            try:
                await self._dispatch(identity, message)
            except Exception:  # one bad message must not stop the pool
                log.exception("error handling %s", type(message).__name__)

    async def _dispatch(self, identity: bytes, message: Any) -> None:
        if isinstance(message, Register):
            await self._register(identity, message)
            return
        worker = self.workers.get(identity)
        if worker is None:
            if isinstance(message, Heartbeat):
                # A worker we dropped (or that outlived a gateway restart): ask it to register again.
                await self._send(identity, Registered(ok=False, error="reregister"))
            return
        worker.last_seen = time.monotonic()
        if isinstance(message, Heartbeat):
            worker.active, worker.queued, worker.cache = message.active, message.queued, message.cache
            return
        if isinstance(message, (Event, Done, Failed, TokenCount, Compacted)):
            channel = self.channels.get(message.req_id)
            if channel is not None:
                channel.put(message)
                if channel.finished:
                    worker.inflight.discard(message.req_id)
            elif isinstance(message, Event):
                await self._send(identity, Cancel(message.req_id))

    async def _register(self, identity: bytes, message: Register) -> None:
        if message.version != PROTOCOL_VERSION:
            error = f"protocol version {message.version} is not {PROTOCOL_VERSION}"
            log.warning("refused worker %s: %s", message.worker_id, error)
            await self._send(identity, Registered(ok=False, error=error))
            return
        old = self.workers.get(identity)
        if old is not None:
            self._fail_inflight(old, "the worker restarted")
        self.workers[identity] = WorkerHandle(identity, message, time.monotonic())
        self._remember(message)
        log.info(
            "worker registered",
            extra={"worker": message.worker_id, "model": message.model, "pid": message.pid},
        )
        await self._send(identity, Registered(ok=True))
        self._registered.set()

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.heartbeat_timeout_s / 4))
            now = time.monotonic()
            for identity, worker in list(self.workers.items()):
                if now - worker.last_seen > self.heartbeat_timeout_s:
                    log.warning("worker %s stopped heartbeating", worker.info.worker_id)
                    del self.workers[identity]
                    self._fail_inflight(worker, "the worker stopped responding")
            if not self.workers:
                self._registered.clear()

    def _fail_inflight(self, worker: WorkerHandle, reason: str) -> None:
        for req_id in list(worker.inflight):
            channel = self.channels.get(req_id)
            if channel is not None:
                channel.put(Failed(req_id, 502, "server_error", f"{reason} during generation"))
        worker.inflight.clear()
