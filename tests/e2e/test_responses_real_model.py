"""The bundled model through real gateway and worker processes, driven by the OpenAI SDK."""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest

from tests.conformance import assert_error, assert_event, assert_response, assert_stream
from tests.support import Kiln, stream

MODEL = "smollm2-135m-instruct"
STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def test_plain_response_has_text(openai_client):
    resp = openai_client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=24, temperature=0)
    assert_response(resp.model_dump(mode="json", exclude_unset=True))
    assert resp.status in ("completed", "incomplete")
    assert resp.output_text.strip()
    assert resp.usage.input_tokens > 0 and resp.usage.output_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def test_streamed_events_arrive_in_order(http):
    names, events = stream(http, {"model": MODEL, "input": "Say hello.", "max_output_tokens": 48, "temperature": 0})
    assert_stream(events, names)
    collapsed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    terminal = collapsed[-1]
    expected = STREAM_ORDER[:-1] + [terminal]
    assert collapsed == expected, collapsed
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text and text == events[-1]["response"]["output"][0]["content"][0]["text"]


def test_sdk_stream_helper(openai_client):
    seen = []
    with openai_client.responses.stream(model=MODEL, input="Say yes.", max_output_tokens=64, temperature=0) as s:
        for event in s:
            seen.append(event)
            assert_event(event.model_dump(mode="json", exclude_unset=True))
    assert seen[0].type == "response.created" and seen[-1].type in ("response.completed", "response.incomplete")
    assert seen[-1].response.output_text


def test_max_output_tokens_gives_incomplete(openai_client):
    resp = openai_client.responses.create(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=5)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5
    assert_response(resp.model_dump(mode="json", exclude_unset=True))


def test_temperature_zero_is_deterministic(openai_client):
    a = openai_client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=12, temperature=0)
    b = openai_client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=12, temperature=0)
    assert a.output_text == b.output_text


def test_instructions_and_roles_render(openai_client):
    resp = openai_client.responses.create(
        model=MODEL,
        instructions="You answer in one word.",
        input=[
            {"role": "developer", "content": "Be terse."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Is water wet?"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Yes."}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't say more."}]},
            {"role": "user", "content": "And fire?"},
        ],
        max_output_tokens=8,
    )
    assert resp.output_text is not None
    assert resp.instructions == "You answer in one word."


def test_top_logprobs_on_output_text(openai_client):
    resp = openai_client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, top_logprobs=2, temperature=0)
    part = resp.output[0].content[0]
    assert len(part.logprobs) >= 1
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert_response(resp.model_dump(mode="json", exclude_unset=True))


def test_bad_input_is_refused_before_generation(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.responses.create(model=MODEL, input="hi", temperature=3)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.responses.create(model="gpt-404", input="hi")
    assert err.value.body["code"] == "model_not_found"


def test_client_disconnect_stops_generation(kiln, http):
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "Tell me a very long story.", "stream": True, "max_output_tokens": 2000}) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        workers = http.get("/health").json()["workers"]
        if all(w["active"] == 0 for w in workers):
            break
        time.sleep(0.3)
    assert all(w["active"] == 0 for w in http.get("/health").json()["workers"])


def test_killed_worker_fails_stream_and_gateway_survives(tmp_path):
    server = Kiln(tmp_path, workers=1).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            with client.stream("POST", "/v1/responses", json={"model": MODEL, "input": "Write a long poem.", "stream": True, "max_output_tokens": 500}) as r:
                events = []
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "response.output_text.delta" and server.worker_procs[0].alive():
                        server.worker_procs[0].kill(signal.SIGKILL)
            assert events[-1]["type"] == "response.failed"
            assert_stream(events)
            r = client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
            assert r.status_code in (404, 503)  # no worker left for the model
            assert_error(r.json())
            assert client.get("/health").status_code == 503
            server.add_worker()
            server.wait_ready(120)
            assert client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3}).status_code == 200
    finally:
        server.stop()
