"""Kiln in front of a real llama-server: the gateway and ``kiln-worker --engine upstream``.

llama-server is the one bench/llama_cpp.py builds (``python -m bench.llama_cpp``), or one on
PATH; without either the module is skipped with that reason (it never builds: minutes of CPU).
It serves the bundled SmolLM2 GGUF; the worker reads the tokenizer and chat template from the
same file, renders every prompt and parses every token, llama-server only samples. One
llama-server process for the module: the engine-down test freezes it (SIGSTOP: it still accepts
connections and answers nothing, the harder case than a refused connection) and thaws it.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.conformance import assert_response
from tests.support import Kiln, Proc, free_port, process_env, wait_until

MODEL = "smollm2-135m-instruct"
SLOT_CONTEXT = 2048  # per llama-server slot: 2 slots of a 4096 context
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]},
}


def llama_server_binary() -> Path:
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    try:
        from bench.llama_cpp import BuildError, plan

        binary = plan().binary
    except (ImportError, BuildError) as exc:
        pytest.skip(f"no llama-server: {exc}")
    if not binary.is_file():
        pytest.skip(f"no llama-server on PATH or at {binary}: build it with `python -m bench.llama_cpp`")
    return binary


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kiln.worker.loading.loader import bundled_model_path

    binary = llama_server_binary()
    port = free_port()
    tmp = tmp_path_factory.mktemp("llama-server")
    # One thread: ggml's threads spin while they wait for each other, and on a loaded 2-core
    # machine two of them made each token take seconds (0.4 tokens/s against ~20 with one).
    argv = [str(binary), "-m", str(bundled_model_path()), "--host", "127.0.0.1", "--port", str(port), "--parallel", "2", "--ctx-size", str(2 * SLOT_CONTEXT), "--threads", "1", "--threads-batch",
        "1", "--no-webui"]
    proc = Proc(argv, process_env({}), tmp / "llama-server.log").start()
    url = f"http://127.0.0.1:{port}"
    if not wait_until(lambda: _health(url) == 200, 120):
        proc.kill()
        raise RuntimeError(f"llama-server did not start:\n{proc.log()}")
    yield proc, url
    if proc.alive():
        proc.process.send_signal(signal.SIGCONT)
    proc.kill(signal.SIGTERM)


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _busy_slots(url: str) -> int:
    return sum(1 for slot in httpx.get(url + "/slots", timeout=5).json() if slot.get("is_processing"))


@pytest.fixture(scope="module")
def kiln(engine, tmp_path_factory):
    _, url = engine
    args = ["--engine", "upstream", "--upstream", url, "--upstream-kind", "llama-server", "--max-batch", "2", "--context-length", str(SLOT_CONTEXT)]
    server = Kiln(tmp_path_factory.mktemp("kiln-upstream"), worker_args=args).start(timeout=120)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(kiln):
    return openai.OpenAI(base_url=kiln.base_url + "/v1", api_key="sk-local", max_retries=0, timeout=300)


def test_responses_sync_and_stream(client):
    resp = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=32, temperature=0)
    assert_response(resp.model_dump(mode="json", exclude_unset=True))
    assert resp.status in ("completed", "incomplete") and resp.output_text.strip()
    assert resp.usage.input_tokens > 0 and 0 < resp.usage.output_tokens <= 32
    with client.responses.stream(model=MODEL, input="What is the capital of France?", max_output_tokens=32, temperature=0) as s:
        events = list(s)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response  # response.completed, or response.incomplete at the token cap
    assert "".join(deltas) == final.output_text == resp.output_text  # greedy: the same text either way
    assert final.usage.output_tokens == resp.usage.output_tokens


def test_a_second_turn_reuses_the_engine_prefix_cache(client):
    first = client.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=24, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And three fruits?", max_output_tokens=24, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output_text.strip()
    assert second.usage.input_tokens > first.usage.input_tokens  # the history came along
    assert second.usage.input_tokens_details.cached_tokens > 0  # llama-server's own count


def test_tool_call_round_trip(client):
    first = client.responses.create(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=80)
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)  # constrained by llama-server
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21, "sky": "clear"}'}],
        tools=[WEATHER], max_output_tokens=48)
    assert follow.status in ("completed", "incomplete")
    assert any(o.type in ("message", "function_call") for o in follow.output)


def test_json_schema_output(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}
    resp = client.responses.create(model=MODEL, input="Invent a person.", text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}, max_output_tokens=80,
        temperature=0)
    person = json.loads(resp.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_chat_completions_and_anthropic_messages(client, kiln):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=24, temperature=0)
    assert chat.choices[0].message.content.strip() and chat.usage.completion_tokens > 0
    claude = anthropic.Anthropic(base_url=kiln.base_url, api_key="sk-local", max_retries=0, timeout=300)
    message = claude.messages.create(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Say hello."}])
    assert message.content[0].type == "text" and message.content[0].text.strip()
    assert message.usage.output_tokens > 0


def test_a_cut_stream_frees_the_llama_server_slot(kiln, engine):
    _, url = engine
    assert wait_until(lambda: _busy_slots(url) == 0, 15)  # the last test's slot is released
    # Greedy and a counting prompt: the model keeps going for hundreds of tokens. A story at
    # temperature 1 sometimes ended within the few deltas read, and the slot was free already.
    body = {"model": MODEL, "input": "Count from 1 to 1000, one number per line.", "max_output_tokens": 1500, "temperature": 0.0, "stream": True}
    with httpx.Client(base_url=kiln.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/responses", json=body) as r:
            deltas = 0
            for line in r.iter_lines():
                deltas += line.startswith("data: ") and '"response.output_text.delta"' in line
                if deltas >= 2:
                    break
            busy = _busy_slots(url)
            if busy == 0:
                # The model ends this answer by itself after ~120 tokens, and on a quiet machine
                # llama-server has sampled all of them before the gateway has relayed two (it
                # samples the 135M model several times faster than one stream is relayed): the
                # slot is free with nothing cut. Reading on got every delta and "completed".
                pytest.skip("llama-server had finished the whole answer before the client left: nothing to cut")
            assert busy == 1  # still generating when the client goes
    # 1500 tokens would take llama-server a minute here; the slot frees as soon as the cancel lands.
    assert wait_until(lambda: _busy_slots(url) == 0, 15), "llama-server kept generating for a client that left"


def test_engine_down_is_503_then_recovers(kiln, engine, client):
    proc, url = engine
    proc.process.send_signal(signal.SIGSTOP)  # frozen: accepts connections, answers nothing
    try:
        # While requests keep coming, the worker answers each one 503 itself (the first within
        # two failed health probes, the rest at once): none waits on the frozen engine.
        for _ in range(3):
            started = time.monotonic()
            r = httpx.post(kiln.base_url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 8}, timeout=60)
            assert r.status_code == 503 and time.monotonic() - started < 20, (r.status_code, r.text)
            assert r.json()["error"]["code"] == "server_is_overloaded"
        # Silent while its engine is down (no registration, no heartbeat), the worker leaves the
        # gateway's pool after its heartbeat timeout; the gateway then answers 503 + Retry-After.
        assert wait_until(lambda: httpx.get(kiln.base_url + "/health", timeout=5).json()["workers"] == [], 30)
        r = httpx.post(kiln.base_url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 8}, timeout=30)
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, dict(r.headers))
    finally:
        proc.process.send_signal(signal.SIGCONT)
    assert wait_until(lambda: _serves(client), 60), "the model did not come back with its engine"


def _serves(client: openai.OpenAI) -> bool:
    try:
        return client.responses.create(model=MODEL, input="hi", max_output_tokens=8).status in ("completed", "incomplete")
    except openai.APIStatusError:
        return False


def test_a_conversation_carries_its_turns(client):
    conversation = client.conversations.create()
    first = client.responses.create(model=MODEL, conversation=conversation.id, input="My name is Ada.", max_output_tokens=16, temperature=0)
    second = client.responses.create(model=MODEL, conversation=conversation.id, input="What is my name?", max_output_tokens=16, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the first turn came along
    items = client.conversations.items.list(conversation.id)
    assert len([i for i in items.data if i.type == "message"]) == 4


def test_websocket_turns_continue_on_the_socket(client):
    with client.responses.connect() as conn:
        conn.response.create(model=MODEL, input="My name is Ada.", max_output_tokens=16, temperature=0, store=False)
        first = _ws_final(conn)
        conn.response.create(model=MODEL, input=[{"role": "user", "content": "And my name?"}], previous_response_id=first["id"], max_output_tokens=16, temperature=0, store=False)
        second = _ws_final(conn)
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0  # llama-server kept the prefix


def _ws_final(conn) -> dict:
    while True:
        frame = json.loads(conn.recv_bytes())
        if frame["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            assert frame["type"] in ("response.completed", "response.incomplete"), frame
            return frame["response"]


def test_hosted_metering_bills_what_was_delivered(engine, tmp_path_factory):
    """A hosted gateway (API keys, a priced catalog, the ledger in SQLite) in front of the same
    llama-server: the ledger row of each generation holds the tokens its client was told, a cut
    stream included."""
    from tests.e2e.test_hosted_gateway import auth, gen_id, ledger, new_org

    _, url = engine
    tmp = tmp_path_factory.mktemp("hosted-upstream")
    db = f"sqlite:///{tmp}/kiln.db"
    key = new_org(db, "acme", concurrency=8)
    catalog = tmp / "catalog.toml"
    catalog.write_text(f'[models."{MODEL}"]\ninput = "0.10"\ncached_input = "0.05"\noutput = "0.30"\n')
    gateway = ["--auth", "keys", "--database-url", db, "--catalog", str(catalog), "--store", "none", "--admin-token", "admin-upstream-test"]
    worker = ["--engine", "upstream", "--upstream", url, "--upstream-kind", "llama-server", "--max-batch", "2", "--context-length", str(SLOT_CONTEXT)]
    server = Kiln(tmp, gateway_args=gateway, worker_args=worker).start(timeout=120)
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            whole = http.post("/v1/responses", json={"model": MODEL, "input": "Say hello.", "max_output_tokens": 16}, headers=auth(key))
            assert whole.status_code == 200, whole.text
            usage = whole.json()["usage"]
            with http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "Write a long story.", "max_output_tokens": 400, "temperature": 1.0, "stream": True}, headers=auth(key)) as s:
                cut = gen_id(s)
                deltas = 0
                for line in s.iter_lines():
                    deltas += line.startswith("data: ") and '"response.output_text.delta"' in line
                    if deltas >= 8:
                        break
        row = ledger(db)[gen_id(whole)]
        assert (row["input_tokens"], row["output_tokens"]) == (usage["input_tokens"], usage["output_tokens"]), row
        assert wait_until(lambda: ledger(db)[cut]["status"] != "pending", 30)
        cut_row = ledger(db)[cut]
        assert cut_row["status"] == "incomplete" and cut_row["output_tokens"] >= 8 and cut_row["cost_nanousd"] > 0, cut_row
    finally:
        server.stop()
