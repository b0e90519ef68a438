"""The worker's ZeroMQ loop: register and heartbeat with every gateway, shuttle messages to the service.

A worker serves every gateway it is given (the replicas of a scaled-out gateway): one DEALER per
gateway, each a ``GatewayLink`` that registers, heartbeats and takes requests on its own, while
they all share the one service and so the one scheduler. That is what keeps capacity honest: the
scheduler admits at most its batch plus queue whichever gateway asks, and refuses the rest with
``Failed(503, server_is_overloaded)``. Each request is answered on the link it arrived on, and
only that link may cancel it.

Gateways come and go without the worker restarting. ZeroMQ reconnects by itself; the link redoes
registration when its gateway says it does not know this worker (``reregister``: it restarted) and
when the gateway has been silent past its heartbeat timeout (it answers every heartbeat, see
``Registered``). In both cases the requests that gateway sent are cancelled: nobody is left to read
them, and they must not run to the end holding slots the other gateways need.

Gateways may also be discovered (``--discover-redis``, worker/discovery.py): the loop opens a link
for each newly advertised gateway and closes a discovered link once its gateway is neither
advertised nor answering.

Threads: this I/O loop owns the DEALER sockets and does nothing slow, so heartbeats never wait
on work (the service queues rendering and tokenizing on its preparation threads). The scheduler
and preparation threads produce events; since ZeroMQ sockets are single-threaded, every other
thread sends through its own PUSH socket to an inproc PULL that this loop polls alongside the
DEALERs, so events go out the moment they exist.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kiln.protocol import (
    HEARTBEAT_INTERVAL_S,
    Cancel,
    Compact,
    Compacted,
    CountTokens,
    Done,
    Failed,
    Generate,
    Heartbeat,
    InvalidRequest,
    ProtocolError,
    Register,
    Registered,
    TokenCount,
    decode,
    encode,
)
from kiln.protocol.security import secure_worker_socket

from .memory import resident_bytes

log = logging.getLogger("kiln.worker.server")

# The messages that end a request: after one, the link no longer holds it.
TERMINAL = (Done, Failed, TokenCount, Compacted)


def read_frame(frame: bytes) -> Any:
    """The message in ``frame``; for a request whose values are out of range, the ``Failed``
    400 naming the parameter that answers it (the service never sees it). Raises ProtocolError
    for a frame that is no message."""
    try:
        return decode(frame)
    except InvalidRequest as exc:
        return Failed(exc.req_id, 400, "invalid_request_error", exc.message, exc.param)

# How often an unregistered link offers its Register (it is dropped while the gateway is
# unreachable, so this is also how soon a gateway that comes up sees the worker): first after
# REGISTER_FIRST_RETRY_S, then twice as long each time up to REGISTER_RETRY_S. The first offer
# usually goes while the connection is still being made, so waiting the whole 0.25 s after it
# added that much to every start.
REGISTER_FIRST_RETRY_S = 0.01
REGISTER_RETRY_S = 0.25
# Messages a link queues for a connected gateway that reads slower than the worker writes. A
# request whose message does not fit (or whose gateway is not connected) is cancelled: sending
# must never block the loop that serves the other gateways, and a stream with a hole is broken.
SEND_HWM = 10_000


@dataclass
class GatewayLink:
    """One gateway this worker serves: its socket, whether it knows us, the requests it sent."""

    index: int
    address: str
    socket: zmq.Socket[bytes]
    registered: bool = False
    heard: float = 0.0  # when this gateway last sent anything (monotonic)
    timeout_s: float | None = None  # its heartbeat timeout once it said so (None: never given up on)
    requests: set[str] = field(default_factory=set)  # received and not yet answered terminally
    emit: Callable[[Any], None] = lambda _message: None  # how the service answers its requests
    discovered: bool = False  # advertised in Redis rather than given with --gateway

    def send(self, payload: bytes) -> bool:
        """Send without blocking; False when the gateway is unreachable or too far behind."""
        try:
            self.socket.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def silent(self, now: float) -> bool:
        return self.registered and self.timeout_s is not None and now - self.heard > self.timeout_s


class Outbox:
    """Thread-safe sending: one PUSH socket per thread, all into the I/O loop's PULL.

    Each frame names the link and request it belongs to, so the loop sends it on the right
    DEALER and knows when a request ends."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self._ctx = ctx
        self._address = address
        self._local = threading.local()
        self._sockets: list[zmq.Socket[bytes]] = []
        self._lock = threading.Lock()

    def emitter(self, link: int) -> Callable[[Any], None]:
        """The ``emit`` the service answers one link's requests through."""
        tag = str(link).encode()
        return lambda message: self.send(tag, message)

    def send(self, link: bytes, message: Any) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self._address)
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        final = b"1" if isinstance(message, TERMINAL) else b""
        sock.send_multipart([link, str(message.req_id).encode(), final, encode(message)])

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                sock.close()


class WorkerServer:
    def __init__(self, gateways: str | list[str], service: Any, *, model_id: str, aliases: list[str], context_window: int, capacity: int, queue_depth: int, features: dict[str, Any] | None = None,
        secret: str | None = None, discovery: Any = None, ready: Callable[[], bool] | None = None, memory: dict[str, int] | None = None) -> None:
        self.gateways = [gateways] if isinstance(gateways, str) else list(gateways)
        # Gateways advertised in Redis (worker/discovery.py), served besides the given ones.
        self.discovery = discovery
        if not self.gateways and discovery is None:
            raise ValueError("a worker needs a gateway, or a way to discover them")
        self.secret = secret  # the worker secret: each DEALER becomes a CURVE client (None: plain)
        # Whether the engine can serve (an upstream engine answers its health probe). While it
        # cannot, the worker neither registers nor heartbeats, so each gateway drops it after its
        # heartbeat timeout and answers the model 503 with Retry-After until it is back.
        self.ready = ready or (lambda: True)
        self.service = service
        self.worker_id = f"worker-{uuid.uuid4().hex[:12]}"
        self.register = Register(
            worker_id=self.worker_id,
            model=model_id,
            aliases=aliases,
            context_window=context_window,
            capacity=capacity,
            queue_depth=queue_depth,
            pid=os.getpid(),
            features=features or {},
            memory=memory or {},
        )
        self._stop = threading.Event()
        self._register_frame = encode(self.register)
        self._links: dict[int, GatewayLink] = {}  # by index, while running
        self._next_index = 0

    def stop(self) -> None:
        self._stop.set()

    def _open(self, ctx: zmq.Context[zmq.Socket[bytes]], poller: zmq.Poller, outbox: Outbox, address: str, *, discovered: bool = False) -> GatewayLink:
        dealer = ctx.socket(zmq.DEALER)
        secure_worker_socket(dealer, self.secret)
        # No IDENTITY: the gateway's ROUTER gives each connection a routing id of its own, so no
        # other process can take over this worker's connection by claiming its (public) id.
        dealer.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a gateway that is not connected: what it missed is stale when it
        # comes back (it has forgotten those requests), and registration is redone anyway.
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        dealer.setsockopt(zmq.SNDHWM, SEND_HWM)
        dealer.connect(address)
        index, self._next_index = self._next_index, self._next_index + 1  # never reused
        link = GatewayLink(index, address, dealer, heard=time.monotonic(), emit=outbox.emitter(index), discovered=discovered)
        self._links[index] = link
        poller.register(dealer, zmq.POLLIN)
        log.info("connecting", extra={"gateway": address, "worker": self.worker_id, "discovered": discovered})
        return link

    def _close(self, poller: zmq.Poller, link: GatewayLink) -> None:
        self._forget(link)
        poller.unregister(link.socket)
        link.socket.close(0)
        del self._links[link.index]
        log.info("stopped serving gateway", extra={"gateway": link.address})

    def _rediscover(self, ctx: zmq.Context[zmq.Socket[bytes]], poller: zmq.Poller, outbox: Outbox) -> None:
        """Serve newly advertised gateways; let go of discovered ones no longer advertised once
        they stop answering (a gateway that still answers is never dropped for Redis's sake)."""
        advertised = self.discovery.addresses() if self.discovery is not None else None
        if advertised is None:
            return
        served = {link.address for link in self._links.values()}
        for address in sorted(advertised - served):
            self._open(ctx, poller, outbox, address, discovered=True)
        for link in list(self._links.values()):
            if link.discovered and link.address not in advertised and not link.registered:
                self._close(poller, link)

    def run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        inbox_address = f"inproc://kiln-outbox-{self.worker_id}"
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(inbox_address)
        outbox = Outbox(ctx, inbox_address)
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        for address in self.gateways:
            self._open(ctx, poller, outbox, address)
        if self.discovery is not None:
            self.discovery.start()
        next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
        next_register, retry = time.monotonic(), REGISTER_FIRST_RETRY_S
        try:
            while not self._stop.is_set():
                links = list(self._links.values())
                now = time.monotonic()
                wake = min(next_beat, next_register) if any(not link.registered for link in links) else next_beat
                for sock, _ in poller.poll(max(0, min(int((wake - now) * 1000), 200))):
                    if sock is inbox:
                        self._forward(inbox.recv_multipart())
                        continue
                    link = next(link for link in links if link.socket is sock)
                    self._receive(link, sock.recv())
                now = time.monotonic()
                for link in links:
                    if link.silent(now):
                        log.warning("gateway stopped answering", extra={"gateway": link.address, "seconds": link.timeout_s})
                        self._forget(link)
                ready = self.ready()
                if not ready:
                    self._unready()
                if now >= next_beat:
                    next_beat = now + HEARTBEAT_INTERVAL_S
                    self._beat()
                if now >= next_register:
                    next_register, retry = now + retry, min(2 * retry, REGISTER_RETRY_S)
                    self._rediscover(ctx, poller, outbox)
                    for link in self._links.values():
                        if not link.registered and ready:
                            link.send(self._register_frame)
                    if all(link.registered for link in self._links.values()):
                        retry = REGISTER_FIRST_RETRY_S
        finally:
            if self.discovery is not None:
                self.discovery.stop()
            outbox.close()
            inbox.close(0)
            for link in self._links.values():
                link.socket.close(0)
            self._links.clear()

    # -- the loop's steps ------------------------------------------------------------------------
    def _receive(self, link: GatewayLink, frame: bytes) -> None:
        link.heard = time.monotonic()
        try:
            message = read_frame(frame)
        except ProtocolError as exc:
            log.warning("dropped frame: %s", exc, extra={"gateway": link.address})
            return
        if isinstance(message, Failed):  # a request out of range: answered, never started
            link.send(encode(message))
            return
        if isinstance(message, Registered):
            self._registered(link, message)
            return
        req_id = getattr(message, "req_id", None)
        if not isinstance(req_id, str):
            log.warning("dropped %s without a request id", type(message).__name__, extra={"gateway": link.address})
            return
        if isinstance(message, Cancel):
            if req_id in link.requests:  # only the gateway that sent a request may stop it
                link.requests.discard(req_id)
                self._handle(message, link.emit)
            return
        if any(req_id in other.requests for other in self._links.values()):
            # Request ids are random per gateway; a repeat is a gateway's bug, refused on its own.
            link.send(encode(Failed(req_id, 500, "server_error", "This request id is already in use on the worker.")))
            return
        link.requests.add(req_id)
        self._handle(message, link.emit)

    def _registered(self, link: GatewayLink, message: Registered) -> None:
        if message.ok:
            if not link.registered:
                log.info("registered with gateway", extra={"gateway": link.address})
            link.registered = True
            timeout = message.heartbeat_timeout_s
            if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
                # It answers our heartbeats, so silence shorter than two of them means nothing.
                link.timeout_s = max(float(timeout), 2 * HEARTBEAT_INTERVAL_S)
            else:
                link.timeout_s = None
        elif message.error == "reregister":
            # The gateway does not know us (it restarted, or dropped us): the requests it sent
            # are forgotten there, so they end here too, and we register again at once.
            self._forget(link)
            link.send(self._register_frame)
        else:
            raise SystemExit(f"gateway {link.address} refused this worker: {message.error}")

    def _unready(self) -> None:
        """The engine stopped answering: go silent on every link (registered again once it is back)."""
        for link in self._links.values():
            if link.registered:
                log.warning("engine not ready: leaving the gateway's pool", extra={"gateway": link.address})
                link.registered = False

    def _forget(self, link: GatewayLink) -> None:
        """The gateway is gone or has forgotten us: cancel what it sent, and register again."""
        link.registered = False
        if link.requests:
            log.warning("cancelled the requests of a gateway that is gone", extra={"gateway": link.address, "requests": len(link.requests)})
        for req_id in list(link.requests):
            self._handle(Cancel(req_id), lambda _message: None)
        link.requests.clear()

    def _forward(self, frames: list[bytes]) -> None:
        """Send one service message on the link its request came from."""
        tag, rid, final, payload = frames
        link = self._links.get(int(tag))
        req_id = rid.decode()
        if link is None or req_id not in link.requests:
            return  # cancelled, or its gateway forgot it: nobody reads it
        if final:
            link.requests.discard(req_id)
        if not link.send(payload) and not final:
            # The gateway is unreachable or hopelessly behind: a stream with a hole is broken,
            # so stop generating it (the gateway's own deadlines end it on its side).
            log.warning("could not deliver to the gateway; cancelled the request", extra={"gateway": link.address, "req_id": req_id})
            link.requests.discard(req_id)
            self._handle(Cancel(req_id), lambda _message: None)

    def _beat(self) -> None:
        stats = self.service.stats()
        held = sum(len(link.requests) for link in self._links.values())
        rss = resident_bytes()
        for link in self._links.values():
            if link.registered:
                others = held - len(link.requests)
                link.send(encode(Heartbeat(self.worker_id, stats.get("active", 0), stats.get("queued", 0), stats, others, rss)))

    def _handle(self, message: Any, emit: Callable[[Any], None]) -> None:
        """Pass one message to the service, which only queues work, so this returns at once.
        A failure here fails that request; the loop (and so the heartbeat) carries on."""
        try:
            self._dispatch(message, emit)
        except Exception:
            log.exception("could not handle %s", type(message).__name__)
            req_id = getattr(message, "req_id", None)
            if req_id is not None and not isinstance(message, Cancel):
                emit(Failed(req_id, 500, "server_error", "The worker could not accept this request."))

    def _dispatch(self, message: Any, emit: Callable[[Any], None]) -> None:
        if isinstance(message, Generate):
            self.service.generate(message, emit)
        elif isinstance(message, CountTokens):
            self.service.count(message, emit)
        elif isinstance(message, Compact):
            self.service.compact(message, emit)
        elif isinstance(message, Cancel):
            self.service.cancel(message.req_id)
