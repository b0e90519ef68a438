"""Real gateway and worker processes: huge prompts and bad seeds never cost the worker its place.

A 10 MB prompt used to be rendered and tokenized on the worker's heartbeat thread, so the
gateway declared the worker dead for 11-30 s and every request failed. Now it is refused as
context_length_exceeded from a byte bound, off that thread, while a normal stream carries on.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support import Kiln, stream

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
NORMAL = {"model": MODEL, "input": "Count from one to ten.", "max_output_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The body limit is set explicitly: these prompts must reach the worker, whatever the default.
    kiln = Kiln(tmp_path_factory.mktemp("reliability"), gateway_args=["--max-body-bytes", str(32 << 20)], worker_args=["--max-batch", "4"]).start()
    yield kiln
    kiln.stop()


def _post(base_url: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        return client.post("/v1/responses", json=body)


def _gateway_log(kiln: Kiln) -> str:
    return kiln.gateway.log_path.read_text(errors="replace")


@pytest.mark.parametrize("burst", [20, pytest.param(50, marks=pytest.mark.slow)])
def test_huge_prompts_are_refused_while_a_stream_runs_and_the_worker_stays(server, burst):
    finished: dict = {}

    def normal_stream() -> None:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            finished["names"], finished["events"] = stream(client, NORMAL)

    runner = threading.Thread(target=normal_stream)
    runner.start()
    try:
        huge = _post(server.base_url, {"model": MODEL, "input": "x" * (10 << 20), "max_output_tokens": 8})
        assert huge.status_code == 400, huge.text[:500]
        assert huge.json()["error"]["code"] == "context_length_exceeded"
        assert "Error" not in huge.json()["error"]["message"]
        big = {"model": MODEL, "input": "y" * (1 << 20), "max_output_tokens": 8}
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _post(server.base_url, big), range(burst)))
        assert [r.status_code for r in answers] == [400] * burst
        assert {r.json()["error"]["code"] for r in answers} == {"context_length_exceeded"}
    finally:
        runner.join(180)
    assert not runner.is_alive(), "the normal stream did not finish"
    assert finished["names"][-1] in ("response.completed", "response.incomplete")
    after = _post(server.base_url, NORMAL)
    assert after.status_code == 200 and after.json()["output"], after.text[:500]
    assert "stopped heartbeating" not in _gateway_log(server)
    assert all(p.alive() for p in server.procs)


def test_a_bad_seed_fails_alone_among_concurrent_streams(server):
    """Whichever side refuses it (the gateway validates too), the bad seed is a 400 naming
    'seed' and the three streams beside it complete."""
    bodies = [dict(NORMAL, seed=s, temperature=0.7) for s in (1, 2, -1, 3)]

    def one(body: dict):
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    r.read()
                    return r.status_code, r.json(), None
                return 200, None, [line for line in r.iter_lines() if line.startswith("event: ")]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, bodies))
    for body, (status, error, names) in zip(bodies, results, strict=False):
        if body["seed"] == -1:
            if status == 200:  # refused in-stream by the worker
                assert names[-1] == "event: response.failed"
            else:
                assert status == 400 and error["error"]["param"] == "seed"
        else:
            assert status == 200 and names[-1] in ("event: response.completed", "event: response.incomplete")
    assert "stopped heartbeating" not in _gateway_log(server)
