"""Cache-aware routing with the real model: two worker processes, the OpenAI SDK, and the prefix
cache as the reason stickiness matters. Which worker served a request is read from ``/metrics``.
The routing rules themselves are tested in detail with the scripted engine
(tests/gateway/test_routing.py)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.conformance import assert_response
from tests.gateway.test_routing import busy, routed
from tests.support import Kiln

MODEL = "smollm2-135m-instruct"
# A stream that cannot end early: the grammar demands a long string, so its worker stays busy.
LONG = {"format": {"type": "json_schema", "name": "essay", "strict": True,
    "schema": {"type": "object", "properties": {"essay": {"type": "string", "minLength": 600, "maxLength": 700}}, "required": ["essay"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    server = Kiln(tmp_path_factory.mktemp("routing-real"), workers=2).start()
    yield server
    server.stop()


def test_conversation_stays_on_the_worker_holding_its_prefix(two_workers):
    sdk = OpenAI(base_url=two_workers.base_url + "/v1", api_key="unused", timeout=600, max_retries=0)
    http = httpx.Client(base_url=two_workers.base_url, timeout=600)
    history = [{"role": "user", "content": "My cat is called Miso and she is nine years old. Reply with OK."}]

    before = routed(http)
    first = sdk.responses.create(model=MODEL, input=history, prompt_cache_key="chat-miso", max_output_tokens=8, temperature=0)
    assert_response(first.model_dump(mode="json", exclude_unset=True))
    home = _grew(before, routed(http))
    history += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "How old is my cat?"}]

    # A long stream of the same conversation key keeps its worker the busier one.
    with busy(two_workers.base_url, "chat-miso", body={"text": LONG, "temperature": 0}, model=MODEL):
        before = routed(http)
        second = sdk.responses.create(model=MODEL, input=history, prompt_cache_key="chat-miso", max_output_tokens=8, temperature=0)
        assert _grew(before, routed(http)) == home, "the conversation left the worker holding its prefix"
        assert second.usage.input_tokens_details.cached_tokens > 0

        # The same turn without a key goes to the idle worker, which has never seen the prefix.
        before = routed(http)
        control = sdk.responses.create(model=MODEL, input=history, max_output_tokens=8, temperature=0)
        assert _grew(before, routed(http)) != home
        assert control.usage.input_tokens_details.cached_tokens == 0


def _grew(before: dict[str, float], after: dict[str, float]) -> str:
    grew = [w for w in after if after[w] > before.get(w, 0)]
    assert len(grew) == 1, (before, after)
    return grew[0]
