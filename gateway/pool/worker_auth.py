"""The gateway's side of worker authentication: a ZAP handler and a log of refused peers.

The ROUTER is a CURVE server (kiln.protocol.security). libzmq asks a ZAP handler, over
``inproc://zeromq.zap.01`` in the same context, whether each client that completed the CURVE
handshake may connect; ours admits exactly the key derived from the worker secret. Peers that fail
earlier (no CURVE at all, or a different secret, so they cannot even encrypt to our key) show up
only as handshake-failure events on a socket monitor.

A refused worker keeps reconnecting every ~100 ms, so refusals are logged once per peer (by
address where ZeroMQ tells us one, by failure kind where it does not) and then summarized at most
once per quiet period, instead of flooding the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from kiln.protocol.security import ZAP_DOMAIN, CurveKeys

from ..lifecycle.tasks import stop_tasks

log = logging.getLogger("kiln.gateway.pool.workers")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_WHY: dict[int, str] = {
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): "it does not use CURVE (no --worker-secret set on that worker?)",
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): "its worker secret differs from the gateway's",
}


@dataclass
class _Seen:
    warned_at: float
    suppressed: int = 0


class RefusalLog:
    """One warning per refused peer, then at most one summary per ``quiet_s``."""

    def __init__(self, quiet_s: float = 300.0, limit: int = 1024) -> None:
        self.quiet_s = quiet_s
        self.limit = limit
        self._seen: OrderedDict[str, _Seen] = OrderedDict()
        self.total = 0  # refusals noted, warned or not

    def refuse(self, peer: str, message: str) -> None:
        """Note one refusal of ``peer``; ``message`` is what the warning says."""
        self.total += 1
        now = time.monotonic()
        seen = self._seen.get(peer)
        if seen is not None and now - seen.warned_at < self.quiet_s:
            seen.suppressed += 1
            return
        again = f" ({seen.suppressed} more attempts since the last warning)" if seen and seen.suppressed else ""
        log.warning("%s%s", message, again)
        self._seen.pop(peer, None)
        self._seen[peer] = _Seen(now)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)


class WorkerAuthenticator:
    """Runs the ZAP handler and the handshake monitor of one CURVE-server ROUTER."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: CurveKeys) -> None:
        self._ctx = ctx
        self._client_key = z85.decode(keys.client_public)
        self.refusals = RefusalLog()
        self._zap: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._watched: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Bind the ZAP handler; call before the ROUTER binds, so no client is ever unchecked."""
        zap = self._ctx.socket(zmq.ROUTER)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(ZAP_ENDPOINT)
        self._zap = zap
        self._tasks.append(asyncio.create_task(self._zap_loop(), name="kiln-pool-zap"))

    def watch(self, sock: zmq.asyncio.Socket) -> None:
        """Log peers whose CURVE handshake with ``sock`` fails (call before ``sock.bind``)."""
        self._monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        self._watched = sock
        self._tasks.append(asyncio.create_task(self._monitor_loop(), name="kiln-pool-monitor"))

    async def stop(self) -> None:
        await stop_tasks(self._tasks)
        self._tasks = []
        if self._watched is not None:
            try:
                self._watched.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in (self._monitor, self._zap):
            if sock is not None:
                sock.close(0)
        self._monitor = self._zap = self._watched = None

    async def _zap_loop(self) -> None:
        assert self._zap is not None
        while True:
            frames = await self._zap.recv_multipart()
            # ZAP request (RFC 27): envelope, "", version, request id, domain, address,
            # identity, mechanism, credentials...
            if len(frames) < 8 or frames[1] != b"":
                continue
            envelope, version, request_id = frames[0], frames[2], frames[3]
            domain, address, mechanism, credentials = frames[4], frames[5], frames[7], frames[8:]
            ok = version == b"1.0" and domain == ZAP_DOMAIN and mechanism == b"CURVE" and credentials == [self._client_key]
            if not ok:
                peer = address.decode(errors="replace") or "an unknown address"
                self.refusals.refuse(f"zap:{peer}", f"refused a worker connection from {peer}: its CURVE key is not derived from the gateway's worker secret")
            status, text = (b"200", b"OK") if ok else (b"400", b"not a kiln worker")
            await self._zap.send_multipart([envelope, b"", b"1.0", request_id, status, text, b"", b""])

    async def _monitor_loop(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            value = int(event["value"])
            why = _WHY.get(value, "its CURVE handshake failed")
            endpoint = event["endpoint"].decode(errors="replace")
            # ZeroMQ names only our own endpoint here, not the peer's, so the kind of failure
            # stands in for the peer.
            self.refusals.refuse(f"handshake:{value}", f"refused a worker connection on {endpoint}: {why}")
