"""WebSocket mode end to end: the OpenAI Python SDK's own websocket client
(``client.responses.connect()``) against real gateway and worker processes with the bundled model.

Every frame is checked against ``ResponsesServerEvent`` of the official bundle.
"""

from __future__ import annotations

import json
import uuid

import pytest
import websockets.sync.client
from openai import OpenAI
from websockets.exceptions import InvalidStatus

from tests.conformance.websocket import assert_ws_error, assert_ws_frame, assert_ws_turn
from tests.support import Kiln

MODEL = "smollm2-135m-instruct"
TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
def client(kiln) -> OpenAI:
    return OpenAI(base_url=kiln.base_url + "/v1", api_key="sk-local", max_retries=0, timeout=300)


def turn(conn, **body) -> list[dict]:
    """One response.create through the SDK; its frames (raw JSON, each also parsed by the SDK)."""
    conn.response.create(model=MODEL, temperature=0, **body)
    return collect(conn)


def collect(conn) -> list[dict]:
    frames = []
    while True:
        raw = conn.recv_bytes()
        frame = json.loads(raw)
        assert conn.parse_event(raw).type == frame["type"]  # the SDK understands it
        frames.append(frame)
        if frame["type"] in TERMINAL:
            return frames


def final(frames: list[dict]) -> dict:
    assert frames[-1]["type"] in ("response.completed", "response.incomplete"), frames[-1]
    return frames[-1]["response"]


def test_a_turn_completes_and_every_frame_validates(client):
    with client.responses.connect() as conn:
        frames = turn(conn, input="Say hello.", max_output_tokens=24, store=False)
    assert_ws_turn(frames)
    response = final(frames)
    text = "".join(f["delta"] for f in frames if f["type"] == "response.output_text.delta")
    assert text.strip() and response["usage"]["output_tokens"] > 0


def test_three_store_false_turns_continue_sending_only_new_input(client):
    with client.responses.connect() as conn:
        first = final(turn(conn, input="My name is Ada. Remember it.", max_output_tokens=16, store=False))
        second = final(turn(conn, input=[{"role": "user", "content": "What is two plus two?"}], previous_response_id=first["id"], max_output_tokens=16, store=False))
        third_frames = turn(conn, input=[{"role": "user", "content": "And my name?"}], previous_response_id=second["id"], max_output_tokens=16, store=False)
    assert_ws_turn(third_frames)
    third = final(third_frames)
    # each turn rendered the whole chain: its prompt holds the previous prompt and answer
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"] + second["usage"]["output_tokens"]
    assert third["previous_response_id"] == second["id"]
    # the chain's state was the socket's: the session reused the worker's cache turn after turn
    assert third["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_unknown_previous_id_is_previous_response_not_found(client):
    with client.responses.connect() as conn:
        frames = turn(conn, input="hi", previous_response_id=f"resp_{uuid.uuid4().hex}", store=False)
        assert_ws_error(frames[-1])
        assert frames[-1]["error"]["code"] == "previous_response_not_found" and frames[-1]["status"] == 400
        # recoverable: the same socket takes the full context next
        assert_ws_turn(turn(conn, input="hi", max_output_tokens=8, store=False))


def test_a_reconnect_cannot_continue_the_old_sockets_store_false_chain(client):
    with client.responses.connect() as conn:
        first = final(turn(conn, input="hi", max_output_tokens=8, store=False))
    with client.responses.connect() as conn:
        frames = turn(conn, input="again", previous_response_id=first["id"], store=False)
    assert frames[-1]["type"] == "error" and frames[-1]["error"]["code"] == "previous_response_not_found"


def test_function_call_round_trip_over_the_socket(client):
    with client.responses.connect() as conn:
        frames = turn(conn, input="What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64, store=False)
        assert_ws_turn(frames)
        calls = [i for i in final(frames)["output"] if i["type"] == "function_call"]
        assert calls and calls[0]["name"] == "get_weather"
        assert any(f["type"] == "response.function_call_arguments.done" for f in frames)
        output = {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})}
        answer = turn(conn, input=[output], previous_response_id=final(frames)["id"], tools=[WEATHER_TOOL], max_output_tokens=32, store=False)
    assert_ws_turn(answer)
    assert final(answer)["usage"]["input_tokens"] > final(frames)["usage"]["input_tokens"]


def test_warm_up_then_a_turn_served_from_the_warm_cache(client):
    instructions = "You are a terse assistant for a code review tool. " * 8
    with client.responses.connect() as conn:
        warm_frames = turn(conn, instructions=instructions, input="Review this: print('hi')", generate=False, store=False)
        assert_ws_turn(warm_frames)
        warm = final(warm_frames)
        assert warm["status"] == "completed" and warm["output"] == []
        assert warm["usage"]["output_tokens"] == 0 and warm["usage"]["input_tokens"] > 50
        frames = turn(conn, instructions=instructions, input=[], previous_response_id=warm["id"], max_output_tokens=16, store=False)
    assert_ws_turn(frames)
    usage = final(frames)["usage"]
    # the same prompt: all of it but the last token comes from the warmed cache
    assert usage["input_tokens"] == warm["usage"]["input_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] >= warm["usage"]["input_tokens"] - 2, usage


def test_an_error_frame_for_a_bad_body_leaves_the_socket_usable(client):
    with client.responses.connect() as conn:
        conn.send_raw(json.dumps({"type": "response.create", "model": MODEL, "input": "x", "temperature": "hot"}))
        error = collect(conn)[-1]
        assert_ws_error(error)
        assert error["status"] == 400 and error["error"]["param"] == "temperature"
        conn.send_raw("{broken")
        assert_ws_frame(collect(conn)[-1])
        assert_ws_turn(turn(conn, input="Still there?", max_output_tokens=8, store=False))


def test_websocket_off_answers_the_upgrade_with_426(tmp_path):
    server = Kiln(tmp_path, gateway_args=["--websocket", "off"], worker_args=["--engine", "scripted"]).start(timeout=60)
    try:
        with pytest.raises(InvalidStatus) as refused:
            websockets.sync.client.connect(server.base_url.replace("http", "ws", 1) + "/v1/responses", open_timeout=10)
        assert refused.value.response.status_code == 426
        assert json.loads(refused.value.response.body)["error"]["code"] == "websocket_not_supported"
    finally:
        server.stop()


def test_a_raw_prompt_from_the_client_is_not_rendered(client):
    """``raw_prompt`` is the legacy Completions door's own option (the worker then skips the chat
    template); a socket client that sends it, or any other internal key, gets the answer the
    templated prompt gets: same prompt length, same greedy text."""
    asked = {"model": MODEL, "temperature": 0, "instructions": "Answer in one word.", "input": "What colour is the sky?", "max_output_tokens": 8, "store": False}
    hostile = {**asked, "raw_prompt": "Count to ten: 1, 2,", "kiln_session": "other", "keep_tokens": 1}
    answers = []
    with client.responses.connect() as conn:
        for body in (asked, hostile):
            conn.send({"type": "response.create", **body})  # type: ignore[typeddict-unknown-key]
            frames = collect(conn)
            assert_ws_turn(frames)
            answers.append(final(frames))
    clean, sent = answers
    assert sent["usage"]["input_tokens"] == clean["usage"]["input_tokens"] > 12  # the template, not 8 raw tokens
    assert [o.get("content") for o in sent["output"]] == [o.get("content") for o in clean["output"]]
    assert "raw_prompt" not in sent and sent["instructions"] == "Answer in one word."
