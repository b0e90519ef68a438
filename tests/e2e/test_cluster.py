"""The scale-out topology of docs/deploy.md on loopback, with the real bundled model and the OpenAI
SDK as the client (issue 18, "What must be shown").

HAProxy (configured from deploy/haproxy/haproxy.cfg, tests/cluster.py) round-robins over two
gateways in hosted mode (``--auth keys``, organizations and keys in PostgreSQL, made with the
``kiln`` CLI as an operator would) with ``--store redis`` on one Redis; two workers are each
connected to both gateways (``[[0, 1], [0, 1]]``). The cluster starts once for the module, and
every generation is short (CI runs this on 2 cores).

Which replica answered is read from the ``X-Kiln-Replica`` header HAProxy adds to every answer.
Round robin alternates per request, so ``Cluster.aim`` makes the next request land on a chosen
replica by probing ``/health`` (no generation) until a probe lands on the other one, and
``Cluster.on`` checks the header of the call's own answer: a test never merely assumes where a
request went. Which
worker served a request is read from each gateway's ``/metrics`` (the admin token).

Faults (a replica, a worker or Redis lost) are tests/e2e/test_cluster_faults.py's, and so is the
background job polled and cancelled through the other replica: hosted mode refuses ``background``
(400 ``unsupported_parameter``, docs/hosted.md: a job outlives its HTTP exchange and could not be
metered), so that test runs on that module's local-mode cluster.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.cluster import Cluster, haproxy
from tests.conformance import assert_error, assert_response
from tests.conformance.websocket import assert_ws_turn
from tests.e2e.test_hosted_gateway import ADMIN_TOKEN, _drop_postgres_database, _postgres_database, new_org
from tests.redis_support import drop_namespace, shared_redis_url

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(haproxy() is None, reason="haproxy is not installed (./dev setup installs it where apt is available)")]

MODEL = "smollm2-135m-instruct"
CATALOG = f"""
[models."{MODEL}"]
input = "0.10"
cached_input = "0.05"
output = "0.30"
"""
# A stream that cannot end early: the grammar demands a long string, so it is still running while
# a test does something else (kills its replica, holds the organization's slot).
LONG = {"format": {"type": "json_schema", "name": "essay", "strict": True,
    "schema": {"type": "object", "properties": {"essay": {"type": "string", "minLength": 600, "maxLength": 700}}, "required": ["essay"], "additionalProperties": False}}}
WAIT_S = 60.0  # generous bound on anything that should take a moment


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    redis_url = shared_redis_url()  # skips without Redis
    database = _postgres_database()  # skips without PostgreSQL
    server = None
    try:
        keys = {"main": new_org(database, "cluster", credits="50", concurrency=16), "solo": new_org(database, "solo", credits="5", concurrency=1)}
        (tmp / "catalog.toml").write_text(CATALOG)
        hosted = ["--auth", "keys", "--catalog", str(tmp / "catalog.toml"), "--admin-token", ADMIN_TOKEN]
        server = Cluster(
            tmp, gateways=2, workers=[[0, 1], [0, 1]], store="redis", redis_url=redis_url, database_url=database,
            gateway_args=hosted, worker_args=["--max-batch", "2"], admin_token=ADMIN_TOKEN,
        ).start(timeout=300)
        server.keys = keys
        yield server
    finally:
        if server is not None:
            server.stop()
            drop_namespace(redis_url, str(server.redis_namespace))
        _drop_postgres_database(database)


def _sdk(cluster: Cluster, key: str = "main") -> OpenAI:
    # No SDK retries: whatever the client sees is what HAProxy and the gateways did.
    return OpenAI(base_url=cluster.base_url + "/v1", api_key=cluster.keys[key], max_retries=0, timeout=600)  # a loaded 2-core CI is slow, never silent


def other(cluster: Cluster, replica: str) -> str:
    return next(name for name in cluster.names if name != replica)


def _ask(sdk: OpenAI, text: str) -> str:
    """One short request; the replica that answered it."""
    raw = sdk.responses.with_raw_response.create(model=MODEL, input=text, max_output_tokens=8, temperature=0)
    response = raw.parse()
    assert_response(response.model_dump(mode="json", exclude_unset=True))
    assert response.status in ("completed", "incomplete") and response.output_text
    return raw.headers["x-kiln-replica"]


def _checked(response):
    assert_response(response.model_dump(mode="json", exclude_unset=True))
    return response


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


def test_a_five_turn_chain_alternates_replicas_and_either_replica_reads_and_deletes_it(cluster):
    sdk = _sdk(cluster)
    said = ["My name is Ada.", "I live in Paris.", "I keep a cat.", "I like tea.", "What is my name?"]
    previous, responses = None, []
    for turn, text in enumerate(said):
        response = _checked(cluster.on(cluster.names[turn % 2], sdk.responses.with_raw_response.create, model=MODEL, input=text, previous_response_id=previous, max_output_tokens=8, temperature=0))
        assert response.status in ("completed", "incomplete")
        responses.append(response)
        previous = response.id
    # Each turn's prompt held every earlier turn, whichever replica stored it.
    for before, after in zip(responses, responses[1:], strict=False):
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens

    last, stored_by = responses[-1], cluster.names[(len(said) - 1) % 2]
    reader = other(cluster, stored_by)
    got = _checked(cluster.on(reader, sdk.responses.with_raw_response.retrieve, last.id))
    assert got.id == last.id and got.output_text == last.output_text
    items = cluster.on(reader, sdk.responses.input_items.with_raw_response.list, last.id, order="asc", limit=100).data
    assert [i.content[0].text for i in items if getattr(i, "role", None) == "user"] == said
    assert cluster.on(reader, sdk.responses.with_raw_response.delete, last.id) is None
    cluster.aim(stored_by)
    with pytest.raises(openai.NotFoundError) as gone:
        sdk.responses.retrieve(last.id)
    assert gone.value.response.headers["x-kiln-replica"] == stored_by
    assert_error(gone.value.response.json())


def test_a_conversation_takes_turns_on_both_replicas(cluster):
    sdk = _sdk(cluster)
    a, b = cluster.names
    conversation = cluster.on(a, sdk.conversations.with_raw_response.create)
    said = ["My name is Ada. Reply with OK.", "What is my name?"]
    first = _checked(cluster.on(a, sdk.responses.with_raw_response.create, model=MODEL, conversation=conversation.id, input=said[0], max_output_tokens=8, temperature=0))
    second = _checked(cluster.on(b, sdk.responses.with_raw_response.create, model=MODEL, conversation=conversation.id, input=said[1], max_output_tokens=8, temperature=0))
    # Turn 2, on the other replica, saw turn 1 (its prompt and its reply) in the conversation.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = cluster.on(a, sdk.conversations.items.with_raw_response.list, conversation.id, order="asc", limit=100).data
    assert [c.text for i in items if getattr(i, "role", None) == "user" for c in i.content] == said
    assert sum(1 for i in items if getattr(i, "role", None) == "assistant") == 2


def test_the_organization_concurrency_limit_holds_across_replicas(cluster):
    """The "solo" organization may run one request at a time (the counter is in Redis): while it
    streams on one replica, a request of its own on the other replica gets 429."""
    solo = _sdk(cluster, "solo")
    a, b = cluster.names
    cluster.aim(a)
    with solo.responses.with_streaming_response.create(model=MODEL, input="Write an essay about kilns.", text=LONG, stream=True, temperature=0) as raw:
        assert raw.headers["x-kiln-replica"] == a
        for event in raw.parse():
            if event.type == "response.output_text.delta":
                break  # running: it holds the organization's one slot
        cluster.aim(b)
        with pytest.raises(openai.RateLimitError) as refused:
            solo.responses.create(model=MODEL, input="Hello!", max_output_tokens=4)
        assert refused.value.response.headers["x-kiln-replica"] == b
        assert_error(refused.value.response.json())
        assert refused.value.response.json()["error"]["code"] == "rate_limit_exceeded"
    # Closing the stream frees the slot for the whole deployment (bounded wait: the replica sees
    # the disconnect, then releases).
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            done = cluster.on(b, solo.responses.with_raw_response.create, model=MODEL, input="Hello!", max_output_tokens=4)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the slot was never released"
            time.sleep(0.2)
    assert done.status in ("completed", "incomplete")


def test_turn_two_of_a_session_lands_on_the_worker_that_holds_its_prefix(cluster):
    """Two workers, each on both replicas: turn 1 through one replica, turn 2 (its history plus a
    question) through the other, both with one ``prompt_cache_key``. The key picks the same worker
    on either replica, so turn 2 reuses turn 1's prefix there."""
    assert cluster.worker_ids(0) == cluster.worker_ids(1) and len(cluster.worker_ids(0)) == 2
    sdk = _sdk(cluster)
    a, b = cluster.names
    history = [{"role": "user", "content": "My dog is called Pepper and he likes long walks by the river. Reply with OK."}]
    before = [cluster.routed_by_worker(i) for i in range(2)]
    first = _checked(cluster.on(a, sdk.responses.with_raw_response.create, model=MODEL, input=history, prompt_cache_key="session-pepper", store=False, max_output_tokens=8, temperature=0))
    history += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my dog called?"}]
    second = _checked(cluster.on(b, sdk.responses.with_raw_response.create, model=MODEL, input=history, prompt_cache_key="session-pepper", store=False, max_output_tokens=8, temperature=0))
    after = [cluster.routed_by_worker(i) for i in range(2)]
    served = [[w for w in after[i] if after[i][w] > before[i].get(w, 0)] for i in range(2)]
    assert len(served[0]) == 1 and served[0] == served[1], served
    assert second.usage.input_tokens_details.cached_tokens > 0


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
