"""The pool of connected workers: registration, liveness, routing and per-request channels.

The gateway binds one ROUTER socket; each worker connects a DEALER and registers. Messages for a
request are delivered to that request's ``Channel``. A worker that stops heartbeating is dropped
and every request it held gets a ``Failed`` so that no client waits forever. The pool answers every
heartbeat (``Registered``), so that a worker serving several gateway replicas learns when this one
is gone and stops the requests it sent.

A worker may serve several gateways at once. Its heartbeat then counts the work of all of them
(``active``, ``queued``) and says how much it holds for the others (``others``); this pool's view
of its load is that, or its own in-flight requests plus ``others``, whichever is larger
(``WorkerHandle.load``). Routing by key is rendezvous hashing over worker ids (rendezvous.py), so
every replica sends a conversation to the same worker.

A worker's identity on the wire is the routing id the ROUTER gave its connection, never one it
chose: a Register naming a worker id another live connection holds is ignored, so a process
claiming a worker's id (or pid) can neither take over its requests nor evict it.

Nothing a worker reports is taken on trust: with a worker secret only workers holding it can
connect at all (CURVE, see kiln.protocol.security and worker_auth.py), and a connected worker whose
report is impossible for the request it answers (usage beyond the request's limits: input beyond
the bytes the gateway sent plus a template's allowance, output beyond max_output_tokens; negative
or non-integer counts) is dropped like a dead one, so it cannot bill a tenant for work never done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kiln.protocol import (
    PROTOCOL_VERSION,
    BadReport,
    Cancel,
    Compact,
    Compacted,
    Done,
    Event,
    Failed,
    Generate,
    Heartbeat,
    ProtocolError,
    Register,
    Registered,
    TokenCount,
    decode,
    encode,
)
from kiln.protocol.capabilities import Capabilities
from kiln.protocol.security import derive_keys, secure_gateway_socket
from kiln.protocol.usage import Usage, count_or_zero, is_count

from ..doors.create_request import CreateRequest
from ..http.errors import ApiError
from ..lifecycle.tasks import stop_tasks
from . import rendezvous
from .worker_auth import RefusalLog

log = logging.getLogger("kiln.gateway.pool.workers")

# A request's channel holds at most this many undelivered messages. A worker emits a handful of
# events per token, so this is far above what a client that keeps reading ever accumulates.
CHANNEL_LIMIT = 65536
# Largest context window a worker may announce: beyond any real model, and it bounds the usage
# a worker may report for a request that sets no max_output_tokens.
MAX_CONTEXT_WINDOW = 1 << 24
# Identities of workers dropped for impossible reports that the pool remembers (and refuses).
BANNED_LIMIT = 4096
BANNED_ERROR = "this worker was dropped: it reported usage its request cannot have"
# Tokens a chat template may add around a prompt (role markers, a default system prompt, tool
# instructions). Every other prompt token covers at least one byte of what the gateway sent, so
# a request's input is at most its frame's bytes plus this.
TEMPLATE_TOKENS = 8192


@dataclass(frozen=True)
class UsageLimits:
    """The most usage a worker can truthfully report for one request."""

    max_input_tokens: int
    max_output_tokens: int

    @classmethod
    def of(cls, window: int, max_output_tokens: Any = None, sent_bytes: int | None = None) -> UsageLimits:
        """A request's own output cap (when it sets one), else the worker's context window,
        which also bounds any prompt; the prompt is bounded by what was sent (``sent_bytes``),
        so a worker announcing a huge window cannot bill a short prompt as a huge one."""
        cap = max_output_tokens if is_count(max_output_tokens) and max_output_tokens else window
        prompt = window if sent_bytes is None else min(window, sent_bytes + TEMPLATE_TOKENS)
        return cls(max_input_tokens=prompt, max_output_tokens=min(cap, window))

    @classmethod
    def for_message(cls, info: Register, message: Any, sent_bytes: int | None = None) -> UsageLimits:
        """The limits implied by what the gateway asked ``info``'s worker for, in a frame of
        ``sent_bytes`` (None: unknown, the window bounds the prompt)."""
        cap = None
        if isinstance(message, Generate):
            cap = message.request.sampling.max_output_tokens
        elif isinstance(message, Compact):
            cap = message.max_output_tokens
        return cls.of(info.context_window, cap, sent_bytes)


def usage_violation(usage: Usage, limits: UsageLimits) -> str | None:
    """Why ``usage`` cannot be true for a request with ``limits``, or None when it can.

    Its shape (counts, details within their totals) was checked as the frame was decoded
    (``Usage.from_wire``: a bad one is a ``BadReport``); here, only whether it fits the request.
    """
    if usage.input_tokens > limits.max_input_tokens:
        return f"input_tokens {usage.input_tokens} exceeds the request's limit of {limits.max_input_tokens}"
    if usage.output_tokens > limits.max_output_tokens:
        return f"output_tokens {usage.output_tokens} exceeds the request's limit of {limits.max_output_tokens}"
    return None


def report_violation(message: Any, limits: UsageLimits) -> str | None:
    """Why a worker's message for a request with ``limits`` cannot be true, or None."""
    if isinstance(message, Event):
        if not isinstance(message.events, list) or not all(isinstance(e, dict) for e in message.events):
            return "events is not a list of maps"
        return None if message.usage is None else usage_violation(message.usage, limits)
    if isinstance(message, Done):
        return usage_violation(message.usage, limits)
    if isinstance(message, Compacted):
        for name in ("input_tokens_before", "input_tokens_after"):
            value = getattr(message, name)
            if not is_count(value) or value > limits.max_input_tokens:
                return f"{name} is not an integer between 0 and {limits.max_input_tokens}"
        return usage_violation(message.usage, limits)
    if isinstance(message, TokenCount):
        # A count may exceed the window (that is what the client asks to learn), never be negative.
        return None if is_count(message.input_tokens) else "input_tokens is not a non-negative integer"
    return None


def register_violation(message: Register) -> str | None:
    """Why a Register cannot describe a real worker, or None."""
    if not isinstance(message.model, str) or not message.model:
        return "model is not a name"
    if not isinstance(message.aliases, list) or not all(isinstance(a, str) for a in message.aliases):
        return "aliases is not a list of names"
    if not isinstance(message.worker_id, str):
        return "worker_id is not a string"
    if not is_count(message.context_window) or not 0 < message.context_window <= MAX_CONTEXT_WINDOW:
        return f"context_window is not an integer between 1 and {MAX_CONTEXT_WINDOW}"
    if not is_count(message.capacity) or message.capacity < 1 or not is_count(message.queue_depth):
        return "capacity or queue_depth is not a positive integer"
    return None


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
    others: int = 0  # requests the worker holds for other gateways, as of its last heartbeat
    inflight: set[str] = field(default_factory=set)
    routed: int = 0  # requests sent to this worker since it registered (for /metrics)
    capabilities: Capabilities = field(default_factory=Capabilities)  # read once from Register.features
    rss_bytes: int = 0  # resident memory, from its heartbeats (0: not reported)

    @property
    def names(self) -> set[str]:
        return {self.info.model, *self.info.aliases}

    @property
    def load(self) -> int:
        # Our own in-flight count is current; the heartbeat's figures (every gateway's work in
        # the scheduler, the other gateways' requests) lag by up to a second.
        return max(len(self.inflight) + self.others, self.active + self.queued)

    def overloaded(self) -> bool:
        return self.load >= self.info.capacity + self.info.queue_depth

    def ended(self, req_id: str) -> None:
        """Our request ``req_id`` sent its last message: the worker no longer holds it. The last
        heartbeat's figures counted it, so they drop by one too until the next heartbeat replaces
        them; else a worker that has just finished a burst would look full for up to a heartbeat
        interval, and keys living on it would be sent elsewhere (away from their prefix cache)."""
        if req_id not in self.inflight:
            return
        self.inflight.discard(req_id)
        if self.queued:
            self.queued -= 1
        elif self.active:
            self.active -= 1


class Channel:
    """Messages of one request, in the order the worker sent them."""

    def __init__(self, req_id: str, worker: WorkerHandle, limits: UsageLimits | None = None) -> None:
        self.req_id = req_id
        self.worker = worker
        # What the worker may truthfully report for this request (checked by the pool).
        self.limits = limits or UsageLimits(worker.info.context_window, worker.info.context_window)
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
            self.queue.put_nowait(Failed(self.req_id, 502, "server_error", "client fell too far behind the stream"))

    async def get(self) -> Any:
        return await self.queue.get()


# Headers that name a client's session, for requests without a prompt_cache_key.
SESSION_HEADERS = ("session-id", "session_id", "x-session-id")


def routing_key(request: CreateRequest, session: str | None = None) -> str | None:
    """What keeps a conversation on one worker: ``prompt_cache_key``, else the door's session
    (a session header: Codex sends ``session-id`` on every turn; a WebSocket connection)."""
    return request.prompt_cache_key or session


def _trim(remembered: dict[Any, Any], limit: int) -> None:
    """Forget the oldest entries of an insertion-ordered map beyond ``limit``."""
    while len(remembered) > limit:
        remembered.pop(next(iter(remembered)))


class NoWorker(Exception):
    """No registered worker serves the model (or all that do are full)."""


class WorkerPool:
    def __init__(self, bind: str, *, heartbeat_timeout_s: float = 5.0, secret: str | None = None) -> None:
        self.bind = bind
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # With a worker secret the ROUTER only admits CURVE clients holding it (worker_auth.py).
        self.secret = secret
        self.auth: Any = None  # the WorkerAuthenticator while started with a secret
        self.workers: dict[bytes, WorkerHandle] = {}
        self.channels: dict[str, Channel] = {}
        self._ctx = zmq.asyncio.Context.instance()
        self._own_ctx = False
        self._banned: dict[bytes, None] = {}  # insertion-ordered set, bounded by BANNED_LIMIT
        self._claims = RefusalLog()  # registrations under a worker id another connection holds
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Every name (id or alias) a worker has registered -> its model id, kept after the worker
        # goes, so that a model whose worker is restarting answers 503 (retry) instead of 404.
        self._known: dict[str, str] = {}
        # The last registration of each model id (bounded like _known), for listing a model that
        # is not loaded now with what it reported when it was.
        self._last: dict[str, WorkerHandle] = {}
        # Names the deployment's config file lists (kiln-gateway --config): 503, never 404.
        self._expected: set[str] = set()
        # Workers being stopped (their model went idle): forgotten by routing, and nothing they
        # send is answered, so they cannot register again before they exit. identity -> model.
        self._retired: dict[bytes, str] = {}
        # Requests waiting for a model id's first worker to register.
        self._arrivals: dict[str, list[asyncio.Future[None]]] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.secret:
            from .worker_auth import WorkerAuthenticator

            # A ZAP handler is per context: a context of our own keeps it to this pool.
            self._ctx, self._own_ctx = zmq.asyncio.Context(), True
            keys = derive_keys(self.secret)
            self.auth = WorkerAuthenticator(self._ctx, keys)
            self.auth.start()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: a connection whose routing id is taken is refused, never handed the
        # live worker's requests (workers let ZeroMQ pick their routing ids, see worker/server.py).
        if self.auth is not None:
            secure_gateway_socket(sock, keys)
            self.auth.watch(sock)
        sock.bind(self.bind)
        self._sock = sock
        self._tasks = [asyncio.create_task(self._receive_loop(), name="kiln-pool-recv"), asyncio.create_task(self._liveness_loop(), name="kiln-pool-liveness")]

    async def stop(self) -> None:
        await stop_tasks(self._tasks)
        if self.auth is not None:
            await self.auth.stop()
            self.auth = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._own_ctx:
            self._ctx.destroy(linger=0)
            self._ctx, self._own_ctx = zmq.asyncio.Context.instance(), False

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
        """Whether ``name`` was served by some worker since the gateway started (bounded memory),
        or is one the config file lists."""
        return name in self._known or name in self._expected

    def expect(self, names: Any) -> None:
        """Names of models this deployment serves even while no worker of theirs is up."""
        self._expected.update(names)

    def handles(self, model: str) -> list[WorkerHandle]:
        """The registered workers whose model id is ``model``."""
        return [w for w in self.workers.values() if w.info.model == model]

    def serves(self, model: str) -> bool:
        return any(w.info.model == model for w in self.workers.values())

    def inflight(self, model: str) -> int:
        """Requests the workers of model id ``model`` hold now."""
        return sum(len(w.inflight) for w in self.handles(model))

    def last_registration(self, model: str) -> WorkerHandle | None:
        """The handle of the last worker of ``model`` that registered (it may be gone since)."""
        return self._last.get(model)

    async def wait_for_model(self, model: str) -> None:
        """Return once a worker whose model id is ``model`` is registered (bound it by the caller)."""
        if self.serves(model):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._arrivals.setdefault(model, [])
        waiters.append(future)
        try:
            await future
        finally:
            if future in waiters:
                waiters.remove(future)
            if not waiters:
                self._arrivals.pop(model, None)

    def retire(self, model: str) -> None:
        """Stop routing to ``model``'s workers, which are about to be stopped: they are forgotten
        now, their requests (the caller checked there are none) fail, and what they send until
        they exit is ignored."""
        for identity, worker in list(self.workers.items()):
            if worker.info.model == model:
                del self.workers[identity]
                self._retired[identity] = model
                self._fail_inflight(worker, "the worker was stopped")
        _trim(self._retired, BANNED_LIMIT)

    def forget_retired(self, model: str) -> None:
        """``model``'s retired workers have exited."""
        for identity in [i for i, m in self._retired.items() if m == model]:
            del self._retired[identity]

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

    def _remember(self, info: Register, handle: WorkerHandle | None = None) -> None:
        for name in (info.model, *info.aliases):
            self._known.pop(name, None)
            self._known[name] = info.model
        _trim(self._known, KNOWN_MODELS_LIMIT)
        if handle is not None:
            self._last.pop(info.model, None)
            self._last[info.model] = handle
            _trim(self._last, KNOWN_MODELS_LIMIT)

    def context_window(self, model: str) -> int | None:
        for w in self.workers.values():
            if model in w.names:
                return w.info.context_window
        return None

    # -- routing ---------------------------------------------------------------------------------
    def pick(self, model: str, cache_key: str | None = None, exclude: Collection[bytes] = ()) -> WorkerHandle:
        """Choose a worker for ``model`` (other than those in ``exclude``).

        Requests sharing a ``cache_key`` go to the key's home among the model's workers (the same
        on every gateway replica, see rendezvous.py), or when it is full to the next of the key's
        workers with room; everything else, and a key whose workers are all full, goes to the
        least-loaded worker.
        """
        candidates = [w for w in self.workers.values() if model in w.names and w.identity not in exclude]
        if not candidates:
            raise NoWorker(model)
        if cache_key is not None:
            for worker in rendezvous.rank(cache_key, candidates, lambda w: w.info.worker_id):
                if not worker.overloaded():
                    return worker
        return min(candidates, key=lambda w: (w.load / max(w.info.capacity, 1), w.load))

    # -- requests --------------------------------------------------------------------------------
    def limits(self, worker: WorkerHandle, max_output_tokens: int | None = None) -> UsageLimits:
        """What ``worker`` may report for a request capped at ``max_output_tokens`` (None: its window)."""
        return UsageLimits.of(worker.info.context_window, max_output_tokens)

    async def open(self, worker: WorkerHandle, req_id: str, message: Any, limits: UsageLimits | None = None) -> Channel:
        """Send ``message`` to ``worker`` and return the channel its answers arrive on.

        ``limits`` bound the usage the worker may report; by default they follow from the message
        (a Generate's max_output_tokens, a Compact's) and the worker's context window.
        """
        # The frame's size bounds the prompt (msgpack runs at memory speed: encoding it once
        # more here is cheap beside tokenizing it).
        channel = Channel(req_id, worker, limits or UsageLimits.for_message(worker.info, message, len(encode(message))))
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
            asyncio.get_running_loop().create_task(self._send(channel.worker.identity, Cancel(channel.req_id)))

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
            except BadReport as exc:
                worker = self.workers.get(identity)
                if worker is not None and identity not in self._retired:
                    self._drop_liar(identity, worker, exc.kind, exc.reason)
                continue
            except ProtocolError as exc:
                log.warning("dropped frame from %r: %s", identity, exc)
                continue
            try:
                await self._dispatch(identity, message)
            except Exception:  # one bad message must not stop the pool
                log.exception("error handling %s", type(message).__name__)

    async def _dispatch(self, identity: bytes, message: Any) -> None:
        if identity in self._retired:
            return  # a worker being stopped: not asked to register again
        if isinstance(message, Register):
            await self._register(identity, message)
            return
        worker = self.workers.get(identity)
        if worker is None:
            if isinstance(message, Heartbeat):
                # A worker we dropped (or that outlived a gateway restart): ask it to register
                # again, unless it was dropped for lying.
                error = BANNED_ERROR if identity in self._banned else "reregister"
                await self._send(identity, Registered(ok=False, error=error))
            return
        worker.last_seen = time.monotonic()
        if isinstance(message, Heartbeat):
            worker.active, worker.queued, worker.cache = count_or_zero(message.active), count_or_zero(message.queued), message.cache
            worker.others = count_or_zero(message.others)
            worker.rss_bytes = count_or_zero(message.rss_bytes)
            await self._send(identity, self._welcome())  # so the worker knows this gateway is there
            return
        if isinstance(message, (Event, Done, Failed, TokenCount, Compacted)):
            channel = self.channels.get(message.req_id)
            if channel is not None and channel.worker is not worker:
                channel = None  # only the worker a request was sent to may answer it
            limits = channel.limits if channel is not None else UsageLimits.for_message(worker.info, None)
            violation = report_violation(message, limits)
            if violation is not None:
                self._drop_liar(identity, worker, type(message).__name__, violation)
                return
            if channel is not None:
                channel.put(message)
                if channel.finished:
                    worker.ended(message.req_id)
            elif isinstance(message, Event):
                await self._send(identity, Cancel(message.req_id))

    async def _register(self, identity: bytes, message: Register) -> None:
        if message.version != PROTOCOL_VERSION:
            error = f"protocol version {message.version} is not {PROTOCOL_VERSION}"
            log.warning("refused worker %s: %s", message.worker_id, error)
            await self._send(identity, Registered(ok=False, error=error))
            return
        if identity in self._banned:  # warned about when it was dropped
            await self._send(identity, Registered(ok=False, error=BANNED_ERROR))
            return
        violation = register_violation(message)
        if violation is not None:
            log.warning("refused worker %r: %s", identity, violation)
            await self._send(identity, Registered(ok=False, error=violation))
            return
        holder = next((w for i, w in self.workers.items() if i != identity and w.info.worker_id == message.worker_id), None)
        if holder is not None:
            # Another connection holds this worker id: an impostor (ids are no secret), or the
            # same worker reconnected before its old connection timed out. Unanswered, the real
            # one keeps retrying and gets in once the old connection is gone; the live worker
            # is never displaced.
            self._claims.refuse(message.worker_id, f"ignored a registration as worker {message.worker_id}: another connection holds that id")
            return
        old = self.workers.get(identity)
        if old is not None and (old.info.worker_id, old.info.pid) == (message.worker_id, message.pid):
            # The same process again (its Register crossed our answer): nothing to undo.
            old.last_seen = time.monotonic()
            await self._send(identity, self._welcome())
            return
        if old is not None:
            self._fail_inflight(old, "the worker restarted")
        handle = WorkerHandle(identity, message, time.monotonic(), capabilities=Capabilities.from_map(message.features))
        self.workers[identity] = handle
        self._remember(message, handle)
        log.info("worker registered", extra={"worker": message.worker_id, "model": message.model, "pid": message.pid})
        await self._send(identity, self._welcome())
        for future in self._arrivals.get(message.model, []):
            if not future.done():
                future.set_result(None)

    def _welcome(self) -> Registered:
        """The answer to a known worker: with our heartbeat timeout, after which (without a word
        from us) the worker gives up on this gateway and cancels what it sent."""
        return Registered(ok=True, heartbeat_timeout_s=self.heartbeat_timeout_s)

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.heartbeat_timeout_s / 4))
            now = time.monotonic()
            for identity, worker in list(self.workers.items()):
                if now - worker.last_seen > self.heartbeat_timeout_s:
                    log.warning("worker %s stopped heartbeating", worker.info.worker_id)
                    del self.workers[identity]
                    self._fail_inflight(worker, "the worker stopped responding")

    def _drop_liar(self, identity: bytes, worker: WorkerHandle, kind: str, violation: str) -> None:
        """Drop a worker whose report cannot be true, as if it had died, and refuse it from now on.

        Its requests (the one it lied about included) fail with 502; none of them is billed the
        usage it claimed. The real worker exits on the refusal and its supervisor restarts it.
        """
        log.warning("dropped worker %s: its %s is impossible (%s)", worker.info.worker_id, kind, violation)
        self.workers.pop(identity, None)
        self._banned[identity] = None
        _trim(self._banned, BANNED_LIMIT)
        self._fail_inflight(worker, "the worker sent an invalid report")
        # Tell it at once (not at its next heartbeat), from a task: dispatch must not block on it.
        asyncio.get_running_loop().create_task(self._send(identity, Registered(ok=False, error=BANNED_ERROR)))

    def _fail_inflight(self, worker: WorkerHandle, reason: str) -> None:
        for req_id in list(worker.inflight):
            channel = self.channels.get(req_id)
            if channel is not None:
                channel.put(Failed(req_id, 502, "server_error", f"{reason} during generation"))
        worker.inflight.clear()
