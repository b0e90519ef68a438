"""The worker's ZeroMQ loop: register, heartbeat, and shuttle messages to the service.

Threads: this I/O loop owns the DEALER socket and does nothing slow, so heartbeats never wait
on work (the service queues rendering and tokenizing on its preparation threads). The scheduler
and preparation threads produce events; since ZeroMQ sockets are single-threaded, every other
thread sends through its own PUSH socket to an inproc PULL that this loop polls alongside the
DEALER, so events go out the moment they exist.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

import zmq

from kiln.protocol import (
    HEARTBEAT_INTERVAL_S,
    Cancel,
    Compact,
    CountTokens,
    Failed,
    Generate,
    Heartbeat,
    ProtocolError,
    Register,
    Registered,
    decode,
    encode,
)
from kiln.protocol.security import secure_worker_socket

from .memory import resident_bytes

log = logging.getLogger("kiln.worker.server")


class Outbox:
    """Thread-safe sending: one PUSH socket per thread, all into the I/O loop's PULL."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self._ctx = ctx
        self._address = address
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self._address)
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        sock.send(encode(message))

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                sock.close()


class WorkerServer:
    def __init__(self, gateway: str, service: Any, *, model_id: str, aliases: list[str], context_window: int, capacity: int, queue_depth: int, features: dict | None = None, secret: str | None = None) -> None:
        self.gateway = gateway
        self.secret = secret  # the worker secret: the DEALER becomes a CURVE client (None: plain)
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
        )
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        secure_worker_socket(dealer, self.secret)
        dealer.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.gateway)
        inbox_address = f"inproc://kiln-outbox-{self.worker_id}"
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(inbox_address)
        outbox = Outbox(ctx, inbox_address)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(inbox, zmq.POLLIN)
        dealer.send(encode(self.register))
        registered = False
        next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
        log.info("connecting", extra={"gateway": self.gateway, "worker": self.worker_id})
        try:
            while not self._stop.is_set():
                timeout_ms = max(0, int((next_beat - time.monotonic()) * 1000))
                for sock, _ in poller.poll(min(timeout_ms, 200)):
                    if sock is inbox:
                        dealer.send(inbox.recv())
                        continue
                    try:
                        message = decode(dealer.recv())
                    except ProtocolError as exc:
                        log.warning("dropped frame: %s", exc)
                        continue
                    if isinstance(message, Registered):
                        if message.ok:
                            registered = True
                            log.info("registered with gateway")
                        elif message.error == "reregister":
                            dealer.send(encode(self.register))
                        else:
                            raise SystemExit(f"gateway refused this worker: {message.error}")
                    else:
                        self._handle(message, outbox.send)
                    message = None  # a big request body must not outlive its handling
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + HEARTBEAT_INTERVAL_S
                    if not registered:
                        dealer.send(encode(self.register))
                    stats = self.service.stats()
                    dealer.send(encode(Heartbeat(self.worker_id, stats.get("active", 0), stats.get("queued", 0), stats, resident_bytes())))
        finally:
            outbox.close()
            inbox.close(0)
            dealer.close(0)

    def _handle(self, message: Any, emit: Any) -> None:
        """Pass one message to the service, which only queues work, so this returns at once.
        A failure here fails that request; the loop (and so the heartbeat) carries on."""
        try:
            self._dispatch(message, emit)
        except Exception:
            log.exception("could not handle %s", type(message).__name__)
            req_id = getattr(message, "req_id", None)
            if req_id is not None and not isinstance(message, Cancel):
                emit(Failed(req_id, 500, "server_error", "The worker could not accept this request."))

    def _dispatch(self, message: Any, emit: Any) -> None:
        if isinstance(message, Generate):
            self.service.generate(message, emit)
        elif isinstance(message, CountTokens):
            self.service.count(message, emit)
        elif isinstance(message, Compact):
            self.service.compact(message, emit)
        elif isinstance(message, Cancel):
            self.service.cancel(message.req_id)
