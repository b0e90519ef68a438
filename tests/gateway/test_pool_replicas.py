"""The worker pool's side of serving workers shared with other gateway replicas.

Fake workers here are plain DEALER sockets speaking the protocol by hand, named as such. What is
checked: every heartbeat is answered (so a worker can tell this gateway is alive), a worker's load
counts the other replicas' work, every replica routes a key to the same worker, and a request a
worker refuses as full goes to another worker with room.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from kiln.gateway.doors.create_request import CreateRequest
from kiln.gateway.lifecycle.generation import Generation, GenerationFailed
from kiln.gateway.lifecycle.response_object import ResponseObject
from kiln.gateway.pool import rendezvous
from kiln.gateway.pool.workers import WorkerHandle, WorkerPool
from kiln.protocol import PROTOCOL_VERSION, Done, Event, Failed, Generate, Heartbeat, Register, Registered, decode, encode
from kiln.protocol.request import GenerateRequest
from kiln.protocol.usage import Usage

from ..support import free_port

MODEL = "fake-model"


def register(worker_id: str, capacity: int = 1, queue_depth: int = 1) -> Register:
    return Register(worker_id, MODEL, [], 2048, capacity, queue_depth, version=PROTOCOL_VERSION, pid=4242)


@pytest.fixture
async def pool():
    pool = WorkerPool(f"tcp://127.0.0.1:{free_port()}", heartbeat_timeout_s=4.0)
    await pool.start()
    yield pool
    await pool.stop()


@pytest.fixture
def ctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def connect(ctx: zmq.asyncio.Context, pool: WorkerPool, worker_id: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, worker_id.encode())
    sock.connect(pool.bind)
    await sock.send(encode(register(worker_id)))
    reply = await next_message(sock, Registered)
    assert reply.ok
    return sock


async def next_message(sock: zmq.asyncio.Socket, kind: type, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if await sock.poll(int(left * 1000)):
            message = decode(await sock.recv())
            if isinstance(message, kind):
                return message
    raise AssertionError(f"no {kind.__name__} within {timeout}s")


async def test_every_heartbeat_is_answered_with_the_gateways_timeout(pool, ctx):
    sock = await connect(ctx, pool, "w-1")
    await sock.send(encode(Heartbeat("w-1", active=1, queued=0, others=3)))
    reply = await next_message(sock, Registered)
    assert reply.ok and reply.heartbeat_timeout_s == 4.0


async def test_a_workers_load_counts_what_it_holds_for_other_gateways(pool, ctx):
    sock = await connect(ctx, pool, "w-1")
    await sock.send(encode(Heartbeat("w-1", active=1, queued=1, others=2)))
    await next_message(sock, Registered)
    worker = next(iter(pool.workers.values()))
    assert worker.load == 2 and worker.overloaded()  # batch 1 + queue 1, both taken elsewhere
    await sock.send(encode(Heartbeat("w-1", active=1, queued=0, others=1)))
    await next_message(sock, Registered)
    channel = await pool.open(worker, "mine", Generate("mine", "resp_1", GenerateRequest("m")))
    # Our own request is not in the heartbeat yet: ours plus the other gateway's.
    assert worker.load == 2
    pool.close(channel, cancel=False)


async def test_a_worker_that_finished_our_requests_has_room_before_its_next_heartbeat(pool, ctx):
    """The heartbeat's figures lag; a request of ours that ended frees its place at once, so a
    key's home that has just finished a burst is not passed over as full."""
    sock = await connect(ctx, pool, "w-1")
    worker = next(iter(pool.workers.values()))
    channels = [await pool.open(worker, f"r-{i}", Generate(f"r-{i}", f"resp_{i}", GenerateRequest("m"))) for i in range(2)]
    await sock.send(encode(Heartbeat("w-1", active=1, queued=1)))
    await next_message(sock, Registered)
    assert worker.overloaded()
    await sock.send(encode(Done("r-0", "completed", Usage(input_tokens=1, output_tokens=1))))
    await asyncio.wait_for(channels[0].get(), 5)
    assert worker.load == 1 and not worker.overloaded()
    for channel in channels:
        pool.close(channel, cancel=False)


async def test_a_register_repeated_by_the_same_process_keeps_its_requests(pool, ctx):
    sock = await connect(ctx, pool, "w-1")
    worker = next(iter(pool.workers.values()))
    channel = await pool.open(worker, "r-1", Generate("r-1", "resp_1", GenerateRequest("m")))
    await sock.send(encode(register("w-1")))  # crossed our answer on the wire
    assert (await next_message(sock, Registered)).ok
    assert channel.queue.empty() and "r-1" in pool.workers[b"w-1"].inflight
    pool.close(channel, cancel=False)


def handles(ids: list[str]) -> dict[bytes, WorkerHandle]:
    return {i.encode(): WorkerHandle(i.encode(), register(i), time.monotonic()) for i in ids}


def test_every_replica_sends_a_key_to_the_same_worker():
    ids = ["worker-a1", "worker-b2", "worker-c3"]
    one, two = WorkerPool("tcp://127.0.0.1:1"), WorkerPool("tcp://127.0.0.1:2")
    one.workers, two.workers = handles(ids), handles(list(reversed(ids)))  # registered in other orders
    keys = [f"conversation-{n}" for n in range(60)]
    homes = {key: one.pick(MODEL, key).info.worker_id for key in keys}
    assert homes == {key: two.pick(MODEL, key).info.worker_id for key in keys}
    assert set(homes.values()) == set(ids)  # and keys spread over the workers
    # A full home sends its keys to the same second choice on every replica.
    key = keys[0]
    home, second = rendezvous.rank(key, ids, str)[:2]
    for pool in (one, two):
        pool.workers[home.encode()].active = 2
    assert one.pick(MODEL, key).info.worker_id == two.pick(MODEL, key).info.worker_id == second


def test_a_worker_joining_takes_only_the_keys_it_wins():
    pool = WorkerPool("tcp://127.0.0.1:1")
    pool.workers = handles(["worker-a1", "worker-b2"])
    keys = [f"session-{n}" for n in range(200)]
    before = {key: pool.pick(MODEL, key).info.worker_id for key in keys}
    pool.workers.update(handles(["worker-c3"]))
    after = {key: pool.pick(MODEL, key).info.worker_id for key in keys}
    moved = {key for key in keys if before[key] != after[key]}
    assert moved and all(after[key] == "worker-c3" for key in moved)


async def fake_worker(sock: zmq.asyncio.Socket, answer) -> list[str]:
    """Answer every Generate with ``answer(req_id)``'s messages; the request ids it got."""
    seen: list[str] = []
    while True:
        message = decode(await sock.recv())
        if isinstance(message, Generate):
            seen.append(message.req_id)
            for reply in answer(message.req_id):
                await sock.send(encode(reply))


def refuse(req_id: str) -> list:
    return [Failed(req_id, 503, "server_is_overloaded", "The worker's queue is full; retry shortly.")]


def serve(req_id: str) -> list:
    item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": []}
    return [Event(req_id, [{"type": "response.output_item.done", "output_index": 0, "item": item}]), Done(req_id, "completed", Usage(input_tokens=1, output_tokens=1))]


async def run_generation(pool: WorkerPool, key: str) -> Generation:
    request = CreateRequest(model=MODEL, prompt_cache_key=key)
    generation = Generation(pool, ResponseObject("resp_1", request, MODEL), request, MODEL)
    await generation.open()
    async for _ in generation.events():
        pass
    return generation


async def test_a_request_refused_as_full_goes_to_another_worker_with_room(pool, ctx):
    full, free = await connect(ctx, pool, "w-full"), await connect(ctx, pool, "w-free")
    key = next(k for k in (f"key-{n}" for n in range(100)) if rendezvous.rank(k, ["w-full", "w-free"], str)[0] == "w-full")
    seen_full = asyncio.ensure_future(fake_worker(full, refuse))
    seen_free = asyncio.ensure_future(fake_worker(free, serve))
    try:
        generation = await asyncio.wait_for(run_generation(pool, key), 10)
        assert generation.response.status == "completed"
        assert pool.workers[b"w-full"].routed == 1 and pool.workers[b"w-free"].routed == 1
    finally:
        seen_full.cancel()
        seen_free.cancel()


async def test_when_every_worker_refuses_the_client_sees_the_overload(pool, ctx):
    one, two = await connect(ctx, pool, "w-1"), await connect(ctx, pool, "w-2")
    tasks = [asyncio.ensure_future(fake_worker(sock, refuse)) for sock in (one, two)]
    try:
        with pytest.raises(GenerationFailed) as failure:
            await asyncio.wait_for(run_generation(pool, "any-key"), 10)
        assert (failure.value.http_status, failure.value.code) == (503, "server_is_overloaded")
        assert [w.routed for w in pool.workers.values()] == [1, 1]  # each asked once
    finally:
        for task in tasks:
            task.cancel()
