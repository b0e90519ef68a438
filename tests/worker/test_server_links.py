"""The worker's I/O loop against two gateways at once (hand-written ROUTER sockets, no processes).

The service is a recording stand-in, named as such: these tests are about which socket a message
travels on, what a heartbeat counts and when a gateway's requests are cancelled, not about
generation (the real loop against real gateways: tests/e2e/test_gateway_replicas.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from kiln.protocol import Cancel, CountTokens, Done, Event, Generate, Heartbeat, Register, Registered, TokenCount, decode, encode
from kiln.protocol.request import GenerateRequest
from kiln.protocol.usage import Usage
from kiln.worker.server import WorkerServer

WAIT_S = 15.0  # generous bound on anything the loop does within a few heartbeats


class RecordingService:
    """Records what the loop hands it; a test answers a request through the emit it was given."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[str, str]] = queue.Queue()
        self.emits: dict[str, Callable[[Any], None]] = {}

    def generate(self, message: Generate, emit: Callable[[Any], None]) -> None:
        self.emits[message.req_id] = emit
        self.calls.put(("generate", message.req_id))

    def count(self, message: CountTokens, emit: Callable[[Any], None]) -> None:
        emit(TokenCount(message.req_id, len(message.req_id)))  # answered at once, like a tiny prompt

    def cancel(self, req_id: str) -> None:
        self.calls.put(("cancel", req_id))

    def stats(self) -> dict[str, Any]:
        return {"active": 0, "queued": 0}

    def next_call(self) -> tuple[str, str]:
        return self.calls.get(timeout=WAIT_S)


class FakeGateway:
    """A ROUTER on loopback, owned by its own thread: it answers Register and Heartbeat as a
    gateway does (while ``answering``), queues everything else, and sends what the test asks."""

    def __init__(self, heartbeat_timeout_s: float = 30.0) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.answering = True
        self.answer: Registered | None = None  # the answer to heartbeats instead of the welcome
        self.received: queue.Queue[Any] = queue.Queue()
        self.heartbeats: queue.Queue[Heartbeat] = queue.Queue()
        self.registers: queue.Queue[Register] = queue.Queue()
        self._outgoing: queue.Queue[Any] = queue.Queue()
        self.identity: bytes | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        self._outgoing.put(message)

    def next(self, kind: type) -> Any:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                message = self.received.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(message, kind):
                return message
        raise AssertionError(f"no {kind.__name__} within {WAIT_S}s")

    def _run(self) -> None:
        while not self._stop.is_set():
            while not self._outgoing.empty() and self.identity is not None:
                self.sock.send_multipart([self.identity, encode(self._outgoing.get())])
            if not self.sock.poll(10):
                continue
            self.identity, frame = self.sock.recv_multipart()
            message = decode(frame)
            if isinstance(message, (Register, Heartbeat)):
                (self.registers if isinstance(message, Register) else self.heartbeats).put(message)
                if self.answering:
                    welcome = Registered(ok=True, heartbeat_timeout_s=self.heartbeat_timeout_s)
                    reply = self.answer if self.answer is not None and isinstance(message, Heartbeat) else welcome
                    self.sock.send_multipart([self.identity, encode(reply)])
                continue
            self.received.put(message)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.destroy(linger=0)


@pytest.fixture
def gateways() -> Iterator[list[FakeGateway]]:
    fakes = [FakeGateway(), FakeGateway()]
    yield fakes
    for fake in fakes:
        fake.close()


def serve(gateways: list[FakeGateway]) -> tuple[WorkerServer, RecordingService, threading.Thread]:
    service = RecordingService()
    server = WorkerServer([g.address for g in gateways], service, model_id="m", aliases=[], context_window=64, capacity=1, queue_depth=1)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for gateway in gateways:
        gateway.registers.get(timeout=WAIT_S)
    return server, service, thread


@pytest.fixture
def worker(gateways):
    server, service, thread = serve(gateways)
    yield service
    server.stop()
    thread.join(5)


def generate(gateway: FakeGateway, service: RecordingService, req_id: str) -> None:
    gateway.send(Generate(req_id, "resp_" + req_id, GenerateRequest("m")))
    assert service.next_call() == ("generate", req_id)


def test_each_request_is_answered_on_the_socket_it_came_from(gateways, worker):
    a, b = gateways
    generate(a, worker, "from-a")
    generate(b, worker, "from-b")
    worker.emits["from-b"](Event("from-b", [{"type": "x"}]))
    worker.emits["from-a"](Done("from-a", "completed", Usage()))
    worker.emits["from-b"](Done("from-b", "completed", Usage()))
    assert a.next(Done).req_id == "from-a"
    assert b.next(Event).req_id == "from-b"
    assert b.next(Done).req_id == "from-b"
    assert a.received.empty()  # nothing of B's request reached A


def test_token_counts_go_back_to_the_gateway_that_asked(gateways, worker):
    a, b = gateways
    a.send(CountTokens("count-a", GenerateRequest("m")))
    b.send(CountTokens("count-bb", GenerateRequest("m")))
    assert a.next(TokenCount) == TokenCount("count-a", 7)
    assert b.next(TokenCount) == TokenCount("count-bb", 8)
    assert a.received.empty() and b.received.empty()


def test_only_the_gateway_that_sent_a_request_can_cancel_it(gateways, worker):
    a, b = gateways
    generate(a, worker, "held-by-a")
    b.send(Cancel("held-by-a"))
    generate(b, worker, "later")  # B's messages are handled in order: its Cancel came first
    a.send(Cancel("held-by-a"))
    assert worker.next_call() == ("cancel", "held-by-a")  # A's cancel, the first one seen
    assert worker.calls.empty()


def test_a_finished_request_sends_nothing_more(gateways, worker):
    a, _ = gateways
    generate(a, worker, "r")
    emit = worker.emits["r"]
    emit(Done("r", "completed", Usage()))
    emit(Event("r", [{"type": "late"}]))  # after the end (a bug) or after a cancel: dropped
    generate(a, worker, "next")
    worker.emits["next"](Done("next", "completed", Usage()))
    assert a.next(Done).req_id == "r"
    assert a.next(Done).req_id == "next"
    assert a.received.empty()


def test_each_heartbeat_counts_the_requests_held_for_the_other_gateways(gateways, worker):
    a, b = gateways
    generate(a, worker, "a1")
    generate(a, worker, "a2")
    generate(b, worker, "b1")
    for gateway, others in ((a, 1), (b, 2)):
        deadline = time.monotonic() + WAIT_S
        while (beat := gateway.heartbeats.get(timeout=WAIT_S)).others != others:
            assert time.monotonic() < deadline, beat


def test_a_gateway_gone_silent_has_its_requests_cancelled_and_is_registered_with_again(gateways):
    a, b = gateways
    a.heartbeat_timeout_s = 1.0
    server, service, thread = serve(gateways)
    try:
        generate(a, service, "orphan")
        generate(b, service, "kept")
        a.answering = False  # A dies: nothing more from it
        assert service.next_call() == ("cancel", "orphan")
        assert service.calls.empty()  # B's request runs on
        a.registers.get(timeout=WAIT_S)  # it offers itself again
        while not a.heartbeats.empty():
            a.heartbeats.get()
        a.answering = True  # A is back (a restart on the same address looks the same)
        a.heartbeats.get(timeout=WAIT_S)  # heartbeats go to a gateway that took the Register
        generate(a, service, "after")
        service.emits["after"](Done("after", "completed", Usage()))
        assert a.next(Done).req_id == "after"
    finally:
        server.stop()
        thread.join(5)


def test_a_gateway_that_forgot_the_worker_gets_its_requests_cancelled_and_a_register(gateways, worker):
    a, b = gateways
    generate(a, worker, "forgotten")
    generate(b, worker, "kept")
    while not a.registers.empty():
        a.registers.get()
    a.answer = Registered(ok=False, error="reregister")  # A restarted: it does not know us
    assert worker.next_call() == ("cancel", "forgotten")
    a.answer = None
    a.registers.get(timeout=WAIT_S)
    assert worker.calls.empty()


def test_gateways_come_from_repeated_flags_and_comma_lists(monkeypatch):
    from kiln.protocol.settings_fields import from_options
    from kiln.worker.cli import gateway_list, main
    from kiln.worker.settings import WorkerSettings

    def gateways(argv: list[str]) -> tuple[str, ...]:
        return gateway_list(from_options(WorkerSettings, main.make_context("kiln-worker", argv).params).gateway)

    monkeypatch.delenv("KILN_GATEWAY", raising=False)
    assert gateways([]) == ("tcp://127.0.0.1:5555",)
    assert gateways(["--gateway", "tcp://a:1", "--gateway", "tcp://b:2,tcp://a:1"]) == ("tcp://a:1", "tcp://b:2")
    monkeypatch.setenv("KILN_GATEWAY", "tcp://a:1, tcp://b:2")
    assert gateways([]) == ("tcp://a:1", "tcp://b:2")


class ListedDiscovery:
    """A stand-in for the Redis discovery (worker/discovery.py): the test sets what is advertised."""

    def __init__(self) -> None:
        self.advertised: frozenset[str] | None = None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def addresses(self) -> frozenset[str] | None:
        return self.advertised


def test_advertised_gateways_are_served_and_let_go_once_gone_and_silent(gateways):
    a, b = gateways
    a.heartbeat_timeout_s = b.heartbeat_timeout_s = 1.0
    discovery = ListedDiscovery()
    service = RecordingService()
    server = WorkerServer([a.address], service, model_id="m", aliases=[], context_window=64, capacity=1, queue_depth=1, discovery=discovery)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        a.registers.get(timeout=WAIT_S)
        discovery.advertised = frozenset({b.address})  # B appears: served without a restart
        b.registers.get(timeout=WAIT_S)
        generate(b, service, "via-b")
        discovery.advertised = frozenset()  # B withdrew, but still answers: kept
        b.heartbeats.get(timeout=WAIT_S)
        b.heartbeats.get(timeout=WAIT_S)
        assert service.calls.empty()
        b.answering = False  # and now it is gone: its request is cancelled, the link closed
        assert service.next_call() == ("cancel", "via-b")
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and b.address in {link.address for link in list(server._links.values())}:
            time.sleep(0.05)
        assert {link.address for link in list(server._links.values())} == {a.address}  # the given one stays
        discovery.advertised = frozenset({b.address})  # back again: served again
        b.answering = True
        b.heartbeats.get(timeout=WAIT_S)
    finally:
        server.stop()
        thread.join(5)
