"""Two ``kiln-gateway`` processes with ``--store redis`` on one Redis, each with its own worker on
the bundled model, driven by the OpenAI Python SDK (issue 18, item 2): a conversation chained
through ``previous_response_id`` whose turns alternate replicas reaches the real model's prompt
whole, and either replica reads, lists and deletes what the other stored.

The full cluster (HAProxy, workers connected to both replicas, PostgreSQL) is another test's.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from tests.conformance import assert_response
from tests.redis_support import drop_namespace, new_namespace, shared_redis_url
from tests.support import Kiln

# Slow suite: tests/e2e/test_cluster.py runs a longer chain across replicas (through HAProxy, hosted) in CI.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    url = shared_redis_url()
    namespace = new_namespace()
    store = ["--store", "redis", "--redis-url", url, "--redis-namespace", namespace]
    servers = [Kiln(tmp_path_factory.mktemp(f"replica{i}"), gateway_args=store, worker_args=["--max-batch", "2"]) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two models load side by side
        started = list(pool.map(lambda s: s.start(), servers))
    yield started
    for server in started:
        server.stop()
    drop_namespace(url, namespace)


def test_chain_alternates_replicas(two_replicas):
    clients = [openai.OpenAI(base_url=s.base_url + "/v1", api_key="sk-local", max_retries=0, timeout=600) for s in two_replicas]
    questions = ["My name is Ada.", "I live in Paris.", "I like tea.", "What is my name?"]
    previous = None
    responses = []
    for turn, question in enumerate(questions):
        client = clients[turn % 2]
        response = client.responses.create(model=MODEL, input=question, previous_response_id=previous, max_output_tokens=12, temperature=0)
        assert response.status in ("completed", "incomplete")
        responses.append(response)
        previous = response.id
    # Each turn's prompt held every earlier turn, whichever replica stored it.
    for before, after in zip(responses, responses[1:], strict=False):
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
    last = responses[-1]
    items = clients[0].responses.input_items.list(last.id, order="asc", limit=100).data
    assert [i.content[0].text for i in items if getattr(i, "role", None) == "user"] == questions
    got = clients[0].responses.retrieve(last.id)  # stored by replica 1, read through replica 0
    assert got.output_text == last.output_text
    assert_response(got.model_dump(mode="json", exclude_unset=True))
    clients[0].responses.delete(last.id)
    with pytest.raises(openai.NotFoundError):
        clients[1].responses.retrieve(last.id)
