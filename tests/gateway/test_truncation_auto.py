"""``truncation: "auto"`` behind ``--truncation-auto`` (off by default, when it is a 400 as the
spec says): the oldest whole turns are left out until the input fits the context window.

The rule is checked on ``truncation.fit`` with a counter of characters; the server path with real
gateway and worker processes and the scripted engine (named as such), whose byte tokenizer makes
token counts exact, on a worker serving a 1,000-token window.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from kiln.gateway.doors.validation import validate_create
from kiln.gateway.http.errors import ApiError
from kiln.gateway.lifecycle import truncation
from tests.conformance import assert_error, assert_response
from tests.support import Kiln

MODEL = "kiln-scripted"


def msg(role: str, text: str) -> dict:
    return {"type": "message", "role": role, "content": text}


def history(turns: int, size: int = 200) -> list[dict]:
    items = [msg("developer", "Be brief.")]
    for t in range(turns):
        items += [msg("user", f"q{t} " + "x" * size), msg("assistant", f"a{t} " + "y" * size)]
    return items + [msg("user", "latest")]


async def _chars(items: list[dict]) -> int:
    return sum(len(str(i.get("content") or i.get("output") or i.get("arguments") or "")) for i in items)


def test_fit_drops_the_oldest_whole_turns_only():
    items = history(5)
    out = asyncio.run(truncation.fit(items, _chars, 1000))
    assert out[0] == items[0]  # the developer message stays
    assert out[-1] == msg("user", "latest")
    assert out[1]["role"] == "user"  # starts at a turn
    assert asyncio.run(_chars(out)) < 999 and out[1:] == items[len(items) - len(out) + 1 :]
    dropped_one_less = [items[0]] + items[len(items) - len(out) - 1 :]
    assert asyncio.run(_chars(dropped_one_less)) >= 999  # the fewest turns were dropped
    assert asyncio.run(truncation.fit(history(1), _chars, 1000)) == history(1)  # fits: unchanged


def test_fit_never_separates_a_call_from_its_output():
    items = [msg("user", "x" * 500), {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}, {"type": "function_call_output", "call_id": "c", "output": "o" * 400},
        msg("assistant", "done"), msg("user", "latest")]
    out = asyncio.run(truncation.fit(items, _chars, 600))
    assert out in (items[3:], items[4:]) and out[-1] == msg("user", "latest")


def test_auto_is_refused_unless_the_gateway_allows_it():
    with pytest.raises(ApiError) as err:
        validate_create({"model": "m", "input": "hi", "truncation": "auto"})
    assert err.value.status == 400 and err.value.param == "truncation"
    assert validate_create({"model": "m", "input": "hi", "truncation": "auto"}, truncation_auto=True).truncation == "auto"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Kiln(tmp_path_factory.mktemp("trunc"), gateway_args=["--truncation-auto"], worker_args=["--engine", "scripted", "--context-length", "1000"]).start(timeout=60)
    yield s
    s.stop()


def test_a_history_past_the_window_is_answered_with_truncation_auto(server):
    sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    items = history(8)
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        refused = c.post("/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 4})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        assert_error(refused.json())
    raw = sdk.responses.with_raw_response.create(model=MODEL, input=items, truncation="auto", max_output_tokens=4)
    assert raw.parse().truncation == "auto"
    body = raw.http_response.json()
    assert_response(body)
    assert body["status"] in ("completed", "incomplete") and body["truncation"] == "auto"
    assert 0 < body["usage"]["input_tokens"] < 1000
