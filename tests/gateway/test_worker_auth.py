"""Workers authenticate (ZeroMQ CURVE from a shared secret), and the gateway never trusts what a
worker reports.

The fake workers here are plain ZeroMQ sockets speaking the protocol by hand, named as such: one
without the secret, one with a wrong one, one that knows the gateway's key but not the workers',
and one that registers properly and then reports usage its request cannot have.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from kiln.gateway.pool.workers import UsageLimits, WorkerPool, usage_violation
from kiln.protocol import PROTOCOL_VERSION, Done, Event, Failed, Generate, Heartbeat, Register, Registered, decode, encode
from kiln.protocol.request import GenerateRequest, Sampling
from kiln.protocol.security import SecretError, derive_keys, is_local_endpoint, load_secret, secure_worker_socket
from kiln.protocol.usage import InvalidUsage, Usage

from ..conformance import assert_error
from ..support import Kiln, free_port, sse_events

SECRET = "correct horse battery staple"
OTHER = "an entirely different secret"


def register(model: str = "fake-model", window: int = 2048) -> Register:
    return Register(f"w-{model}", model, [], window, 1, 1, version=PROTOCOL_VERSION)


def dealer(ctx: zmq.Context, address: str, *, secret: str | None = None, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    secure_worker_socket(sock, secret)
    sock.connect(address)
    return sock


async def recv_within(sock: zmq.asyncio.Socket, timeout: float):
    """The next message on ``sock``, or None if none comes within ``timeout`` seconds."""
    if await sock.poll(int(timeout * 1000)) == 0:
        return None
    return decode(await sock.recv())


async def until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


@pytest.fixture
async def secured_pool():
    pool = WorkerPool(f"tcp://127.0.0.1:{free_port()}", secret=SECRET)
    await pool.start()
    ctx = zmq.asyncio.Context()
    yield pool, ctx
    ctx.destroy(linger=0)
    await pool.stop()


# -- the secret and its keys ---------------------------------------------------------------------


def test_keys_follow_from_the_secret_alone():
    assert derive_keys(SECRET) == derive_keys(SECRET)
    keys, other = derive_keys(SECRET), derive_keys(OTHER)
    assert keys.server_public != other.server_public and keys.client_public != other.client_public
    assert keys.server_public != keys.client_public
    assert zmq.curve_public(keys.client_secret) == keys.client_public


def test_secret_from_a_file_is_stripped_and_checked(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert load_secret(None, str(path)) == SECRET
    assert load_secret(None, None) is None
    with pytest.raises(SecretError, match="not both"):
        load_secret(SECRET, str(path))
    with pytest.raises(SecretError, match="at least"):
        load_secret("short", None)
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(None, str(tmp_path / "missing"))


@pytest.mark.parametrize(("endpoint", "local"), [
    ("tcp://127.0.0.1:5555", True), ("tcp://localhost:5555", True), ("tcp://[::1]:5555", True), ("ipc:///tmp/kiln.sock", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.0.0.7:5555", False), ("tcp://eth0:5555", False), ("tcp://[::]:5555", False),
])
def test_which_worker_addresses_other_hosts_can_reach(endpoint, local):
    assert is_local_endpoint(endpoint) is local


# -- who may register ----------------------------------------------------------------------------


async def test_only_a_worker_with_the_secret_registers(secured_pool):
    pool, ctx = secured_pool
    plain = dealer(ctx, pool.bind)
    wrong = dealer(ctx, pool.bind, secret=OTHER)
    for sock in (plain, wrong):
        await sock.send(encode(register("intruder")))
    good = dealer(ctx, pool.bind, secret=SECRET)
    await good.send(encode(register("fake-model")))
    reply = await recv_within(good, 10)
    assert isinstance(reply, Registered) and reply.ok
    assert [w.info.model for w in pool.workers.values()] == ["fake-model"]
    # The refused ones never got a frame through, in either direction.
    assert await recv_within(plain, 0.3) is None and await recv_within(wrong, 0.3) is None
    assert pool.resolve("intruder") is None


async def test_a_wrong_secret_is_refused_with_one_warning_not_a_flood(secured_pool, caplog):
    pool, ctx = secured_pool
    caplog.set_level(logging.WARNING, logger="kiln.gateway.pool.workers")
    wrong = dealer(ctx, pool.bind, secret=OTHER)
    await wrong.send(encode(register("intruder")))
    # It keeps reconnecting (every ~100 ms); wait until the gateway refused it several times.
    assert await until(lambda: pool.auth.refusals.total >= 3), "the wrong-secret worker was never refused"
    warnings = [r.getMessage() for r in caplog.records if "refused a worker connection" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "secret differs" in warnings[0]
    assert not pool.workers


async def test_knowing_the_gateway_key_is_not_enough(secured_pool, caplog):
    """A client that has the gateway's public key but not the workers' keypair fails at ZAP."""
    pool, ctx = secured_pool
    caplog.set_level(logging.WARNING, logger="kiln.gateway.pool.workers")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = derive_keys(SECRET).server_public, public, secret
    sock.connect(pool.bind)
    await sock.send(encode(register("intruder")))
    assert await until(lambda: pool.auth.refusals.total >= 1)
    assert await recv_within(sock, 0.3) is None
    assert not pool.workers
    warnings = [r.getMessage() for r in caplog.records if "refused a worker connection" in r.getMessage()]
    assert len(warnings) == 1 and "127.0.0.1" in warnings[0], warnings


# -- what a worker may report --------------------------------------------------------------------

LIMITS = UsageLimits(max_input_tokens=2048, max_output_tokens=8)


@pytest.mark.parametrize("usage", [
    {"input_tokens": 5, "output_tokens": 8},
    {"input_tokens": 2048, "input_tokens_details": {"cached_tokens": 2048}, "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}},
    {},
])
def test_usage_a_request_can_have(usage):
    assert _violation(usage) is None


@pytest.mark.parametrize("usage", [
    {"input_tokens": 5, "output_tokens": 100_000_000},
    {"input_tokens": 5, "output_tokens": 9},
    {"input_tokens": 2049, "output_tokens": 1},
    {"input_tokens": -1, "output_tokens": 1},
    {"input_tokens": 5, "output_tokens": 2.5},
    {"input_tokens": "5", "output_tokens": 1},
    {"input_tokens": True, "output_tokens": 1},
    {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 6}},
    {"output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 3}},
    {"input_tokens": 5, "total_tokens": -1},
    {"input_tokens": 5, "input_tokens_details": [1]},
    [5, 8],
])
def test_usage_no_request_can_have(usage):
    assert _violation(usage) is not None


def _violation(wire: object) -> str | None:
    """What the gateway makes of a worker's usage map: its shape is checked as the frame is
    decoded, its size against the request's limits after."""
    try:
        usage = Usage.from_wire(wire)
    except InvalidUsage as exc:
        return str(exc)
    return usage_violation(usage, LIMITS)


async def test_a_worker_that_overreports_usage_is_dropped_and_its_request_fails():
    pool = WorkerPool(f"tcp://127.0.0.1:{free_port()}")
    await pool.start()
    ctx = zmq.asyncio.Context()
    try:
        liar = dealer(ctx, pool.bind, identity=b"w-liar")
        await liar.send(encode(register()))
        assert (await recv_within(liar, 10)).ok
        worker = pool.pick("fake-model")
        honest = await pool.open(worker, "r0", Generate("r0", "resp_0", GenerateRequest("fake-model", sampling=Sampling(max_output_tokens=8))))
        lied = await pool.open(worker, "r1", Generate("r1", "resp_1", GenerateRequest("fake-model", sampling=Sampling(max_output_tokens=8))))
        assert lied.limits == UsageLimits(2048, 8)
        await recv_within(liar, 5)
        await recv_within(liar, 5)
        await liar.send(encode(Done("r0", "completed", Usage(input_tokens=3, output_tokens=8))))
        assert isinstance(await asyncio.wait_for(honest.get(), 10), Done)
        await liar.send(encode(Event("r1", [{"type": "response.output_text.delta", "delta": "x"}])))
        await liar.send(encode(Done("r1", "completed", Usage(input_tokens=3, output_tokens=100_000_000))))
        assert isinstance(await asyncio.wait_for(lied.get(), 10), Event)
        failed = await asyncio.wait_for(lied.get(), 10)
        assert isinstance(failed, Failed) and failed.http_status == 502 and failed.code == "server_error"
        assert "100000000" not in failed.message
        assert not pool.workers
        # It is told so at once, and stays out: neither a heartbeat nor a new Register brings it back.
        refusal = await recv_within(liar, 5)
        assert isinstance(refusal, Registered) and not refusal.ok and refusal.error != "reregister"
        await liar.send(encode(Heartbeat("w-liar")))
        assert (await recv_within(liar, 5)).error != "reregister"
        await liar.send(encode(register()))
        assert not (await recv_within(liar, 5)).ok
        assert not pool.workers
    finally:
        ctx.destroy(linger=0)
        await pool.stop()


async def test_a_worker_whose_usage_is_malformed_is_dropped_like_one_that_overreports():
    # The frame decodes (it is a Done) but its usage is no count: not a frame to drop quietly,
    # which would leave the request waiting, but a worker to stop trusting.
    pool = WorkerPool(f"tcp://127.0.0.1:{free_port()}")
    await pool.start()
    ctx = zmq.asyncio.Context()
    try:
        liar = dealer(ctx, pool.bind, identity=b"w-odd")
        await liar.send(encode(register()))
        assert (await recv_within(liar, 10)).ok
        channel = await pool.open(pool.pick("fake-model"), "r1", Generate("r1", "resp_1", GenerateRequest("fake-model")))
        await recv_within(liar, 5)
        await liar.send(msgpack.packb({"t": "Done", "req_id": "r1", "status": "completed", "usage": {"input_tokens": -3, "output_tokens": 1}}))
        failed = await asyncio.wait_for(channel.get(), 10)
        assert isinstance(failed, Failed) and failed.http_status == 502 and "-3" not in failed.message
        assert not pool.workers
        refusal = await recv_within(liar, 5)
        assert isinstance(refusal, Registered) and not refusal.ok and refusal.error != "reregister"
    finally:
        ctx.destroy(linger=0)
        await pool.stop()


async def test_a_worker_cannot_answer_another_workers_request():
    pool = WorkerPool(f"tcp://127.0.0.1:{free_port()}")
    await pool.start()
    ctx = zmq.asyncio.Context()
    try:
        a = dealer(ctx, pool.bind, identity=b"w-a")
        b = dealer(ctx, pool.bind, identity=b"w-b")
        await a.send(encode(Register("w-a", "model-a", [], 2048, 1, 1)))
        await b.send(encode(Register("w-b", "model-b", [], 2048, 1, 1)))
        assert (await recv_within(a, 10)).ok and (await recv_within(b, 10)).ok
        channel = await pool.open(pool.pick("model-a"), "ra", Generate("ra", "resp_a", GenerateRequest("model-a")))
        await b.send(encode(Done("ra", "completed", Usage(output_tokens=1))))
        await a.send(encode(Done("ra", "incomplete", Usage(output_tokens=2))))
        message = await asyncio.wait_for(channel.get(), 10)
        assert isinstance(message, Done) and message.status == "incomplete"
    finally:
        ctx.destroy(linger=0)
        await pool.stop()


# -- end to end: real processes ------------------------------------------------------------------


class FakeWorker:
    """A hand-written worker on a plain DEALER (no secret), heartbeating while it waits."""

    def __init__(self, address: str, identity: bytes, secret: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        secure_worker_socket(self.sock, secret)
        self.sock.connect(address)
        self.id = identity.decode()

    def wait_for(self, kind: type, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(300):
                message = decode(self.sock.recv())
                if isinstance(message, kind):
                    return message
            self.sock.send(encode(Heartbeat(self.id)))
        raise AssertionError(f"no {kind.__name__} within {timeout}s")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.mark.parametrize("streaming", [False, True], ids=["json", "stream"])
def test_client_never_sees_usage_a_lying_worker_reports(tmp_path, streaming):
    server = Kiln(tmp_path, workers=0, gateway_args=["--heartbeat-timeout", "10"]).start(timeout=60)
    fake = FakeWorker(server.zmq, b"w-liar", server.secret)
    try:
        fake.sock.send(encode(register("fake-model")))
        assert fake.wait_for(Registered).ok
        result: dict = {}

        def post() -> None:
            body = {"model": "fake-model", "input": "hi", "max_output_tokens": 8, "stream": streaming}
            with httpx.Client(base_url=server.base_url, timeout=60) as client, client.stream("POST", "/v1/responses", json=body) as r:
                result["status"] = r.status_code
                result["events"] = sse_events(r)[1] if streaming else None
                result["body"] = r.read() if not streaming else None

        client = threading.Thread(target=post)
        client.start()
        generate = fake.wait_for(Generate)
        fake.sock.send(encode(Event(generate.req_id, [])))
        fake.sock.send(encode(Done(generate.req_id, "completed", Usage(input_tokens=3, output_tokens=100_000_000))))
        client.join(60)
        assert not client.is_alive()
        if streaming:
            last = result["events"][-1]
            assert last["type"] == "response.failed" and last["response"]["error"]["code"] == "server_error"
            assert "100000000" not in json.dumps(result["events"])
        else:
            assert result["status"] == 502
            error = httpx.Response(502, content=result["body"]).json()
            assert_error(error)
            assert "100000000" not in result["body"].decode()
        assert httpx.get(server.base_url + "/health").json()["workers"] == []
        assert "impossible" in server.gateway.log()
    finally:
        fake.close()
        server.stop()


@pytest.fixture(scope="module")
def secured_kiln(tmp_path_factory):
    server = Kiln(tmp_path_factory.mktemp("auth"), worker_args=["--engine", "scripted"], env={"KILN_WORKER_SECRET": SECRET}).start(timeout=60)
    yield server
    server.stop()


def test_worker_with_the_secret_serves_and_intruders_get_nothing(secured_kiln):
    """The real worker, given the secret by environment, registers; encrypted traffic flows."""
    with httpx.Client(base_url=secured_kiln.base_url, timeout=60) as client:
        assert client.post("/v1/responses", json={"model": "kiln-scripted", "input": "hi", "max_output_tokens": 4}).status_code == 200
        ctx = zmq.Context()
        try:
            intruders = [dealer(ctx, secured_kiln.zmq), dealer(ctx, secured_kiln.zmq, secret=OTHER)]
            for sock in intruders:
                sock.send(encode(register("intruder")))
            r = client.post("/v1/responses", json={"model": "intruder", "input": "hi"})
            assert r.status_code == 404
            assert_error(r.json())
            assert [w["model"] for w in client.get("/health").json()["workers"]] == ["kiln-scripted"]
            assert all(sock.poll(300) == 0 for sock in intruders)
        finally:
            ctx.destroy(linger=0)


def test_gateway_refuses_a_public_worker_socket_without_a_secret():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    argv = [sys.executable, "-m", "kiln.gateway", "--port", str(free_port()), "--workers-bind", f"tcp://0.0.0.0:{free_port()}"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--workers-bind tcp://0.0.0.0:" in done.stderr and "worker secret" in done.stderr


def test_kiln_serve_gives_its_children_a_secret_by_environment(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    argv = [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}", "--engine", "scripted"]
    proc = subprocess.Popen(argv, env=env, stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        workers: list = []
        while time.monotonic() < deadline and not workers:
            try:
                workers = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["workers"]
            except (httpx.HTTPError, ValueError):
                time.sleep(0.2)
        assert workers, (tmp_path / "serve.log").read_text()
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2
        for pid in children:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            secret = next(v for v in environ if v.startswith(b"KILN_WORKER_SECRET="))
            assert len(secret) > len("KILN_WORKER_SECRET=") + 16
            assert b"secret" not in open(f"/proc/{pid}/cmdline", "rb").read().lower()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- issue 30 C: no unauthenticated workers by default, no identity theft, bounded usage -------------


def test_gateway_refuses_to_start_without_a_worker_secret_unless_told():
    """Even on loopback, a gateway without a secret would take any local process as a worker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    for extra in ([], ["--auth", "keys", "--database-url", "sqlite:////nonexistent/kiln.db"]):
        argv = [sys.executable, "-m", "kiln.gateway", "--port", str(free_port()), "--workers-bind", f"tcp://127.0.0.1:{free_port()}", *extra]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "--allow-unauthenticated-workers" in done.stderr and "--worker-secret-file" in done.stderr


@pytest.fixture
def open_kiln(tmp_path):
    """A gateway explicitly told to accept unauthenticated workers (the worst case for the tests
    below: any local process may connect), with one scripted worker."""
    server = Kiln(tmp_path, worker_args=["--engine", "scripted", "--scripted-reply", "real worker"], secret=None, gateway_args=["--heartbeat-timeout", "2"]).start(timeout=60)
    yield server
    server.stop()


def _worker_id(server: Kiln) -> str:
    import re

    found = re.search(r"worker-[0-9a-f]{12}", server.worker_procs[0].log())
    assert found, server.worker_procs[0].log()
    return found.group(0)


@pytest.mark.parametrize("same_routing_id", [True, False], ids=["routing-id", "register-only"])
def test_a_rogue_claiming_a_workers_id_and_pid_gets_nothing_and_evicts_nobody(open_kiln, same_routing_id):
    real_id, real_pid = _worker_id(open_kiln), open_kiln.worker_procs[0].process.pid
    ctx = zmq.Context()
    try:
        rogue = dealer(ctx, open_kiln.zmq, identity=real_id.encode() if same_routing_id else None)
        rogue.send(encode(Register(real_id, "kiln-scripted", [], 1 << 24, 8, 8, version=PROTOCOL_VERSION, pid=real_pid)))
        time.sleep(0.5)
        with httpx.Client(base_url=open_kiln.base_url, timeout=30) as client:
            for _ in range(6):
                r = client.post("/v1/responses", json={"model": "kiln-scripted", "input": "my secret prompt", "max_output_tokens": 4})
                assert r.status_code == 200, r.text
                rogue.send(encode(Heartbeat(real_id)))
            got = []
            while rogue.poll(200):
                got.append(decode(rogue.recv()))
            assert not [m for m in got if isinstance(m, Generate)]
            assert not [m for m in got if isinstance(m, Registered) and m.ok]
            rogue.close(0)
            # The real worker was never displaced: it still serves, alone, once the rogue is gone.
            time.sleep(3)
            assert client.post("/v1/responses", json={"model": "kiln-scripted", "input": "hi", "max_output_tokens": 4}).status_code == 200
            assert len(client.get("/health").json()["workers"]) == 1
    finally:
        ctx.destroy(linger=0)


def test_health_names_no_worker_id_or_pid(open_kiln):
    text = httpx.get(open_kiln.base_url + "/health").text
    (worker,) = httpx.get(open_kiln.base_url + "/health").json()["workers"]
    assert "pid" not in worker and "id" not in worker and worker["model"] == "kiln-scripted"
    assert _worker_id(open_kiln) not in text and str(open_kiln.worker_procs[0].process.pid) not in text


async def test_reported_input_is_bounded_by_the_prompt_the_gateway_sent():
    """A worker announcing the largest window cannot bill a short prompt as 16 million tokens."""
    pool = WorkerPool(f"tcp://127.0.0.1:{free_port()}")
    await pool.start()
    ctx = zmq.asyncio.Context()
    try:
        liar = dealer(ctx, pool.bind)
        await liar.send(encode(register(window=1 << 24)))
        assert (await recv_within(liar, 10)).ok
        worker = pool.pick("fake-model")
        channel = await pool.open(worker, "r1", Generate("r1", "resp_1", GenerateRequest("fake-model", sampling=Sampling(max_output_tokens=8))))
        assert channel.limits.max_input_tokens < 10_000 and channel.limits.max_output_tokens == 8
        await recv_within(liar, 5)
        await liar.send(encode(Done("r1", "completed", Usage(input_tokens=16_777_216, output_tokens=8))))
        failed = await asyncio.wait_for(channel.get(), 10)
        assert isinstance(failed, Failed) and failed.http_status == 502
        assert not pool.workers
    finally:
        ctx.destroy(linger=0)
        await pool.stop()
