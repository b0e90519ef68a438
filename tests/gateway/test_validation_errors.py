"""Bad input is refused before generation with the OpenAI error shape and the right status.

Runs against real gateway and worker processes; the scripted engine stands in for the model
because no case here reaches generation.
"""

from __future__ import annotations

import re

import pytest

from tests.conformance import assert_error

MODEL = "kiln-scripted"


def _post(client, body, **kw):
    return client.post("/v1/responses", json=body, **kw)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "input": 5}, "input"),
        ({"model": MODEL, "input": "hi", "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "input": "hi", "temperature": 2.5}, "temperature"),
        ({"model": MODEL, "input": "hi", "top_p": 1.5}, "top_p"),
        ({"model": MODEL, "input": "hi", "top_logprobs": 21}, "top_logprobs"),
        ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
        ({"model": MODEL, "input": "hi", "truncation": "auto"}, "truncation"),
        ({"model": MODEL, "input": "hi", "stream": "maybe"}, "stream"),
        ({"model": MODEL, "input": "hi", "metadata": {"k": 1}}, "metadata"),
        ({"model": MODEL, "input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": MODEL, "input": [{"type": "mystery"}]}, "input[0].type"),
        ({"model": MODEL, "input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "a"}], "tool_choice": {"type": "function", "name": "b"}}, "tool_choice"),
        ({"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "a"}], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "b"}]}}, "tool_choice"),
        ({"model": MODEL, "input": "hi", "background": True, "stream": True}, "background"),
        ({"input": "hi"}, "model"),
    ],
)
def test_bad_fields_are_400_with_param(scripted_http, body, param):
    r = _post(scripted_http, body)
    assert r.status_code == 400, r.text
    assert_error(r.json())
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("kind", ["web_search", "file_search", "computer_use_preview", "code_interpreter", "image_generation", "mcp", "custom", "apply_patch", "function_shell"])
def test_hosted_tools_are_refused(scripted_http, kind):
    r = _post(scripted_http, {"model": MODEL, "input": "hi", "tools": [{"type": kind}]})
    assert r.status_code == 400
    assert_error(r.json())
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_too_many_tools(scripted_http):
    tools = [{"type": "function", "name": f"f{i}", "parameters": {"type": "object"}} for i in range(129)]
    r = _post(scripted_http, {"model": MODEL, "input": "hi", "tools": tools})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_malformed_json(scripted_http):
    r = scripted_http.post("/v1/responses", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert_error(r.json())


def test_unknown_model_is_404(scripted_http):
    r = _post(scripted_http, {"model": "no-such-model", "input": "hi"})
    assert r.status_code == 404
    assert_error(r.json())
    assert r.json()["error"]["code"] == "model_not_found"


def test_body_over_limit_is_413(scripted_http):
    r = _post(scripted_http, {"model": MODEL, "input": "x" * (33 << 20)})
    assert r.status_code == 413
    assert_error(r.json())


def test_aliases_without_v1(scripted_http):
    r = scripted_http.post("/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3})
    assert r.status_code == 200
    assert scripted_http.get("/models").json()["data"][0]["id"] == MODEL


def test_unknown_route_is_openai_shaped(scripted_http):
    r = scripted_http.get("/v1/nothing-here")
    assert r.status_code == 404
    assert_error(r.json())


def test_metrics_endpoint(scripted_http):
    scripted_http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3})
    with scripted_http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True}) as r:
        r.read()
    text = scripted_http.get("/metrics").text
    assert 'kiln_requests_total{route="/v1/responses",status="200"}' in text
    assert "kiln_time_to_first_token_seconds_count" in text and "kiln_inter_token_seconds_bucket" in text
    assert 'kiln_tokens_total{direction="output"}' in text
    assert "kiln_worker_cache_hit_ratio{" in text and "kiln_worker_queue_depth{" in text
    assert "kiln_worker_decode_tokens_total{" in text and "kiln_worker_accepted_draft_tokens_total{" in text
    # Workers are labelled by the tag /health shows, never by their id (a rogue would claim it).
    labels = set(re.findall(r'kiln_worker_requests_total\{[^}]*worker="([^"]+)"', text))
    assert labels and labels == {w["tag"] for w in scripted_http.get("/health").json()["workers"]}
