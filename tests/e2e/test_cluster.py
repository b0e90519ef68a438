"""Gateway replicas behind HAProxy, with the real bundled model and the OpenAI SDK as the client.

What exists today: two gateways, each with its own worker (a worker serves one gateway until
h-fanout lands), stateless requests, WebSocket mode through the balancer, and replica loss. The cluster is tests/cluster.py, with
HAProxy configured from deploy/haproxy/haproxy.cfg. Which replica answered is read twice: from the
``X-Kiln-Replica`` header HAProxy adds, and from each gateway's own ``/metrics``.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.cluster import Cluster, haproxy
from tests.conformance import assert_response
from tests.conformance.websocket import assert_ws_turn

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(haproxy() is None, reason="haproxy is not installed (./dev setup installs it where apt is available)")]

MODEL = "smollm2-135m-instruct"
# A stream that cannot end early: the grammar demands a long string, so it is still running when
# its replica is killed.
LONG = {"format": {"type": "json_schema", "name": "essay", "strict": True, "schema": {"type": "object", "properties": {"essay": {"type": "string", "minLength": 600, "maxLength": 700}}, "required": ["essay"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    server = Cluster(tmp_path_factory.mktemp("cluster"), gateways=2, workers=[[0], [1]]).start()
    yield server
    server.stop()


def _sdk(cluster: Cluster) -> OpenAI:
    # No SDK retries: whatever the client sees is what HAProxy and the gateways did.
    return OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(sdk: OpenAI, text: str) -> str:
    """One short request; the replica that answered it."""
    raw = sdk.responses.with_raw_response.create(model=MODEL, input=text, max_output_tokens=8, temperature=0)
    response = raw.parse()
    assert_response(response.model_dump(mode="json", exclude_unset=True))
    assert response.status in ("completed", "incomplete") and response.output_text
    return raw.headers["x-kiln-replica"]


def _turn(conn, **body) -> list[dict]:
    """One WebSocket-mode turn through the SDK's own client; its frames as JSON."""
    conn.response.create(model=MODEL, temperature=0, **body)
    frames = []
    while not frames or frames[-1]["type"] not in ("response.completed", "response.incomplete", "response.failed", "error"):
        frames.append(json.loads(conn.recv_bytes()))
    return frames


def test_stateless_requests_are_spread_over_both_replicas(cluster):
    sdk = _sdk(cluster)
    before = [cluster.routed(i) for i in range(2)]
    replicas = [_ask(sdk, f"Name a colour, number {n}.") for n in range(4)]
    after = [cluster.routed(i) for i in range(2)]

    assert set(replicas) == set(cluster.names), replicas
    # Each gateway's own count agrees with what HAProxy said: round robin, 2 each.
    assert [after[i] - before[i] for i in range(2)] == [replicas.count(name) for name in cluster.names]


def test_websocket_mode_passes_through_and_a_session_keeps_its_replica(cluster):
    """The upgrade crosses HAProxy, and the socket stays on one replica, so WebSocket mode's
    per-connection continuation holds even with stores that replicas do not share."""
    sdk = _sdk(cluster)
    before = [cluster.routed(i) for i in range(2)]
    with sdk.responses.connect() as conn:
        first = _turn(conn, input="My name is Ada. Reply with OK.", max_output_tokens=8, store=False)
        second = _turn(conn, input="What is my name?", previous_response_id=first[-1]["response"]["id"], max_output_tokens=8, store=False)
    for frames in (first, second):
        assert_ws_turn(frames)
        assert frames[-1]["type"] in ("response.completed", "response.incomplete"), frames[-1]
    grew = [cluster.routed(i) - before[i] for i in range(2)]
    assert sorted(grew) == [0, 2], grew


def test_a_killed_replica_fails_its_own_streams_and_the_other_keeps_answering(cluster):
    sdk = _sdk(cluster)
    with sdk.responses.with_streaming_response.create(model=MODEL, input="Write an essay about kilns.", text=LONG, temperature=0, stream=True) as raw:
        victim = cluster.names.index(raw.headers["x-kiln-replica"])
        events = iter(raw.parse())
        for event in events:
            if event.type == "response.output_text.delta":
                break
        started = time.monotonic()
        cluster.kill_gateway(victim)
        # The stream in flight fails, promptly: a cut, never a hang or a made-up ending.
        with pytest.raises((httpx.HTTPError, openai.APIError)):
            for event in events:
                assert event.type not in ("response.completed", "response.incomplete")
        assert time.monotonic() - started < 30

    survivor = cluster.names[1 - victim]
    # New requests reach the survivor at once, even before HAProxy's health check has marked the
    # victim down: a refused connection is retried on the other replica.
    assert [_ask(sdk, f"Say {n}.") for n in range(3)] == [survivor] * 3
    cluster.wait_until(f"haproxy marks {cluster.names[victim]} down", lambda: cluster.balancer_status()[cluster.names[victim]].startswith("DOWN"), 30)

    # The runbook's "restart it": the worker re-registers by itself, HAProxy puts it back.
    cluster.start_gateway(victim)
    cluster.wait_until(f"{cluster.names[victim]} is back in rotation", lambda: cluster.balancer_status()[cluster.names[victim]] == "UP", 120)
    # Round robin over two replicas up: two requests in a row reach both.
    assert {_ask(sdk, f"Say {n} again.") for n in range(2)} == set(cluster.names)
