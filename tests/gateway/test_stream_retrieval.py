"""Streamed retrieval (issue 15, point 2): ``GET /v1/responses/{id}?stream=true`` replays a
background job's events after ``starting_after`` and follows the live ones to the terminal event;
a reader that leaves changes nothing for the job.

Real processes with the scripted engine (named as such), slowed so the job is still running while
it is read; the buffer's bounds are unit-tested in-process below.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from kiln.gateway.store.events import EventBuffer, TooOld
from tests.conformance import assert_error, assert_stream
from tests.gateway.inprocess import MODEL as INPROC_MODEL
from tests.gateway.inprocess import bounded, client_for, local_app
from tests.support import Kiln

MODEL = "kiln-scripted"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Kiln(tmp_path_factory.mktemp("replay"), worker_args=["--engine", "scripted", "--scripted-delay", "0.02", "--scripted-reply", "streamed retrieval " * 6]).start(timeout=60)
    yield s
    s.stop()


@pytest.fixture
def sdk(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


def _events(stream) -> list[dict]:
    return [e.model_dump(mode="json", exclude_unset=True) for e in stream]


def _wait_terminal(sdk, rid: str) -> None:
    deadline = time.monotonic() + 60
    while sdk.responses.retrieve(rid).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_cut_and_resumed_equals_unbroken(sdk, server):
    job = sdk.responses.create(model=MODEL, input="go", background=True, max_output_tokens=200)
    head = []
    with sdk.responses.retrieve(job.id, stream=True) as stream:
        for event in stream:
            head.append(event.model_dump(mode="json", exclude_unset=True))
            if len(head) == 5:
                break  # the reader leaves; the job goes on
    last = head[-1]["sequence_number"]
    tail = _events(sdk.responses.retrieve(job.id, stream=True, starting_after=last))
    _wait_terminal(sdk, job.id)
    unbroken = _events(sdk.responses.retrieve(job.id, stream=True))
    assert head + tail == unbroken
    assert unbroken[-1]["type"] == "response.completed"
    assert sdk.responses.retrieve(job.id).status == "completed"
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        r = http.get(f"/v1/responses/{job.id}", params={"stream": "true"})
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert_stream(unbroken, names)
    assert unbroken[-1]["response"]["output"][0]["content"][0]["text"] == ("streamed retrieval " * 6)


def test_bad_starting_after_and_unknown_id(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        r = http.get("/v1/responses/resp_nope", params={"stream": "true"})
        assert r.status_code == 404
        assert_error(r.json())
        rid = http.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True, "max_output_tokens": 2}).json()["id"]
        r = http.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"
        r = http.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True, "stream": True})
        assert r.status_code == 400  # the spec's rule stays


async def test_buffer_is_bounded_and_refuses_what_it_dropped():
    buffer = EventBuffer(max_events=3)
    for i in range(5):
        buffer.record({"type": "response.output_text.delta", "delta": str(i)})
    buffer.record({"type": "response.completed", "response": {}})
    with pytest.raises(TooOld):
        await buffer.follow(0).__anext__()
    got = [e async for e in buffer.follow(2)]
    assert [e["sequence_number"] for e in got] == [3, 4, 5]


async def test_follower_sees_live_events_until_terminal():
    buffer = EventBuffer()
    buffer.record({"type": "response.created", "response": {}})

    async def produce():
        for i in range(3):
            await asyncio.sleep(0.01)
            buffer.record({"type": "response.output_text.delta", "delta": str(i)})
        buffer.record({"type": "response.completed", "response": {}})

    task = asyncio.ensure_future(produce())
    got = await asyncio.wait_for(_collect(buffer.follow(None)), 10)
    await task
    assert [e["sequence_number"] for e in got] == [0, 1, 2, 3, 4]


async def _collect(events):
    return [e async for e in events]


def test_stored_foreground_stream_can_be_followed_while_it_runs(server):
    """A second client follows a stored foreground stream by id and gets the very same events."""
    import json
    import threading

    from tests.support import sse_events

    own: list[dict] = []
    first_seen = threading.Event()
    rid: list[str] = []

    def run_stream() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "go", "stream": True, "max_output_tokens": 200}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        own.append(json.loads(line[6:]))
                        if len(own) == 3:
                            rid.append(own[0]["response"]["id"])
                            first_seen.set()

    thread = threading.Thread(target=run_stream)
    thread.start()
    assert first_seen.wait(30)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        r = http.get(f"/v1/responses/{rid[0]}", params={"stream": "true"})
        assert r.status_code == 200, r.text
        names, followed = sse_events(r)
    thread.join(30)
    assert followed == own
    assert_stream(followed, names)
    assert followed[-1]["type"] == "response.completed"


NODE_DIR = __import__("pathlib").Path(__file__).parents[1] / "node"


@pytest.mark.slow
def test_node_sdk_stream_by_response_id_resumes(server):
    """The Node SDK's ``responses.stream({response_id})``, cut and resumed with
    ``starting_after`` (``npm ci`` in tests/node first; the openai package is pinned there)."""
    import json
    import shutil
    import subprocess

    if shutil.which("node") is None or not (NODE_DIR / "node_modules" / "openai").exists():
        pytest.skip("node and tests/node/node_modules are needed (cd tests/node && npm ci)")
    out = subprocess.run(["node", str(NODE_DIR / "stream_resume.mjs"), server.base_url + "/v1", MODEL], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["resumed"] == result["unbroken"]
    assert result["last"] == "response.completed"


async def test_buffer_drops_oldest_events_beyond_its_byte_bound():
    buffer = EventBuffer(max_events=1000, max_bytes=10_000)
    for i in range(10):
        buffer.record({"type": "response.output_text.delta", "delta": str(i) * 2000})
    assert buffer.nbytes <= 10_000
    with pytest.raises(TooOld):
        await buffer.follow(0).__anext__()
    buffer.record({"type": "response.completed", "response": {}})
    got = [e async for e in buffer.follow(7)]
    assert [e["sequence_number"] for e in got] == [8, 9, 10]


async def _finish_background(client, body: dict) -> str:
    r = await bounded(client.post("/v1/responses", json={**body, "background": True}))
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    for _ in range(500):
        if (await bounded(client.get(f"/v1/responses/{rid}"))).json()["status"] not in ("queued", "in_progress"):
            return rid
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} did not finish")


async def test_finished_event_buffers_are_bounded_in_bytes_oldest_evicted():
    """Issue 30 item 5: heavy finished streams (here 1 MB instructions, in each snapshot event)
    are kept within a byte budget, not 256 of them whatever they weigh; the oldest goes first and
    then reads as an expired stream, the newest still replays."""
    app, _ = local_app()
    heavy = {"model": INPROC_MODEL, "input": "hi", "instructions": "x" * (1 << 20)}
    async with client_for(app) as client:
        ids = [await _finish_background(client, heavy) for _ in range(30)]
        oldest = await bounded(client.get(f"/v1/responses/{ids[0]}", params={"stream": "true"}))
        newest = await bounded(client.get(f"/v1/responses/{ids[-1]}", params={"stream": "true"}))
    assert oldest.status_code == 400, oldest.text[:200]
    assert_error(oldest.json())
    assert oldest.json()["error"]["param"] == "stream"
    assert newest.status_code == 200
    assert '"type":"response.completed"' in newest.text
