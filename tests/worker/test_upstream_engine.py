"""The upstream engine (kiln-worker --engine upstream) against recorded exchanges of each engine.

vLLM and SGLang cannot run on these machines, so their side is a fake engine replaying chunks
written from their source and docs (tests/data/upstream/*.json cite which); llama-server's real
behaviour is covered end to end in tests/e2e/test_upstream_llama_server.py. Each test drives the
worker's own GenerationService with the bundled model's tokenizer: what a client would get back
(text, a parsed tool call, usage with the engine's cached tokens, a 400, a 503) and what the
engine was sent (token ids, the constraint), no model weights: seconds.
"""

from __future__ import annotations

import json

import pytest

from kiln.protocol import Done, Event, Failed, Generate
from kiln.protocol.request import ContentPart, GenerateRequest, Message, Sampling, TextFormat, ToolChoice, ToolSpec
from kiln.worker.capabilities import describe
from kiln.worker.service import GenerationService, ServiceConfig
from kiln.worker.setup import model_extras
from kiln.worker.upstream.constraint import Constraints
from kiln.worker.upstream.responses import LlamaServerReader, SglangReader
from kiln.worker.upstream.scheduler import UpstreamScheduler
from kiln.worker.upstream.tokenizer_source import load_tokenizer

from .test_worker_reliability_service import Inbox
from .upstream_fake import FakeEngine, recording

TEXT = "Hello! How can I help?"
WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "Weather in a city.")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None).tokenizer


@pytest.fixture
def upstream(tokenizer):
    """make(kind, exchange, **fake options) -> (service, fake engine); all stopped afterwards."""
    made: list = []

    def make(kind: str, exchange: str = "text", *, constrained: bool = True, url: str | None = None, api_key: str | None = None, **options):
        record = recording(kind)
        fake = FakeEngine(record["path"], record[exchange]["events"], done=record[exchange]["done"], **options)
        scheduler = UpstreamScheduler(url or fake.url, kind, tokenizer.encode, capacity=2, queue_depth=2, model="smol" if kind == "vllm" else None, api_key=api_key)
        scheduler.start()
        made.append((fake, scheduler))
        assert scheduler.wait_checked(10) is (url is None)
        extras = model_extras(tokenizer, None, Constraints(constrained))
        service = GenerationService(tokenizer=tokenizer, scheduler=scheduler, config=ServiceConfig(model_id="m", context_window=8192, default_max_output_tokens=64), **extras)
        return service, fake

    yield make
    for fake, scheduler in made:
        scheduler.stop()
        fake.stop()


def ask(text: str = "Hi", **fields) -> GenerateRequest:
    return GenerateRequest("m", input=(Message("user", (ContentPart("input_text", text),)),), **fields)


def items(inbox: Inbox, req_id: str) -> list[dict]:
    return [e["item"] for m in inbox.of(req_id) if isinstance(m, Event) for e in m.events if e["type"] == "response.output_item.done"]


@pytest.mark.parametrize("kind, cached", [("llama-server", 12), ("vllm", 16), ("sglang", 24)])
def test_each_engine_streams_the_reply_with_its_usage(upstream, tokenizer, kind, cached):
    service, fake = upstream(kind, api_key="sk-engine" if kind == "vllm" else None)
    inbox = Inbox()
    request = ask(sampling=Sampling(temperature=0.5, top_p=0.9, seed=7, max_output_tokens=50))
    service.generate(Generate("r", "resp_r", request), inbox)
    done = inbox.final("r")
    assert isinstance(done, Done) and done.status == "completed"
    (message,) = items(inbox, "r")
    assert message["content"][0]["text"] == TEXT
    prompt = service.prompt_tokens(request)
    assert done.usage.input_tokens == len(prompt) and done.usage.output_tokens == len(tokenizer.encode(TEXT))
    assert done.usage.cached_tokens == cached  # the engine's own count
    (body,) = fake.bodies
    sent = {"llama-server": lambda b: (b["prompt"], b["n_predict"], b["return_tokens"]), "vllm": lambda b: (b["prompt"], b["max_tokens"], b["return_token_ids"]),
        "sglang": lambda b: (b["input_ids"], b["sampling_params"]["max_new_tokens"], b["stream"])}[kind](body)
    assert sent == (prompt, 50, True)
    assert fake.authorizations == (["Bearer sk-engine"] if kind == "vllm" else [None])


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_forced_call_is_constrained_by_the_engine_and_parsed_as_the_mlx_path_parses_it(upstream, tokenizer, kind):
    service, fake = upstream(kind, "tool_call")
    inbox = Inbox()
    request = ask("Weather in Paris?", tools=(WEATHER,), tool_choice=ToolChoice("named", name="get_weather"), sampling=Sampling(max_output_tokens=60))
    service.generate(Generate("r", "resp_r", request), inbox)
    done = inbox.final("r")
    assert isinstance(done, Done) and done.status == "completed"
    (call,) = items(inbox, "r")
    assert call["type"] == "function_call" and call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    (body,) = fake.bodies
    schema = body["structured_outputs"]["json"] if kind == "vllm" else json.loads(body["sampling_params"]["json_schema"])
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"]["additionalProperties"] is False  # strict, as on the MLX path
    prompt = body["prompt"] if kind == "vllm" else body["input_ids"]
    assert prompt[-len(tokenizer.encode("<tool_call>\n")) :] == tokenizer.encode("<tool_call>\n")  # the tag is the worker's


def test_json_schema_output_reaches_llama_server_as_its_json_schema(upstream):
    service, fake = upstream("llama-server")
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]}
    first = Inbox()
    service.generate(Generate("r", "resp_r", ask(text_format=TextFormat("json_schema", name="x", schema=schema))), first)
    first.final("r")  # one at a time: the engine's bodies are then in the requests' order
    inbox = Inbox()
    service.generate(Generate("s", "resp_s", ask()), inbox)
    inbox.final("s")
    assert "pattern" in fake.bodies[0]["json_schema"]["properties"]["when"]  # narrowed like the MLX path's grammar
    assert "json_schema" not in fake.bodies[1]


def test_an_engine_without_constrained_decoding_offers_none_and_refuses_it(upstream, tokenizer):
    service, fake = upstream("vllm", constrained=False)
    inbox = Inbox()
    service.generate(Generate("r", "resp_r", ask(text_format=TextFormat("json_object"))), inbox)
    failed = inbox.final("r")
    assert isinstance(failed, Failed) and failed.http_status == 400 and "constrained decoding" in failed.message
    assert fake.bodies == []
    assert describe(tokenizer, None, Constraints(False), 64).structured_output is False
    assert describe(tokenizer, None, Constraints(True), 64).structured_output is True


def test_a_cancelled_request_closes_its_stream_to_the_engine(upstream):
    service, fake = upstream("llama-server", delay_s=0.05, repeat=200)
    inbox = Inbox()
    service.generate(Generate("r", "resp_r", ask()), inbox)
    assert _wait(lambda: any(isinstance(m, Event) for m in inbox.of("r")))
    service.cancel("r")
    assert fake.aborted.wait(10), "the engine never saw the stream closed"
    assert not any(isinstance(m, (Done, Failed)) for m in inbox.of("r"))  # the gateway already forgot it
    assert _wait(lambda: service.stats()["active"] == 0)


def test_an_engine_that_is_down_gets_503_at_once(upstream, tokenizer):
    service, _ = upstream("llama-server", url="http://127.0.0.1:9")  # nothing listens on the discard port
    inbox = Inbox()
    service.generate(Generate("r", "resp_r", ask()), inbox)
    failed = inbox.final("r", timeout=10)
    assert isinstance(failed, Failed) and failed.http_status == 503 and failed.code == "server_is_overloaded"
    assert "engine" in failed.message


def test_llama_server_text_held_back_mid_character_is_retokenized(tokenizer):
    read = LlamaServerReader(tokenizer.encode)
    assert read({"content": "c", "tokens": [83], "tokens_predicted": 1}).tokens == [83]
    # "é" spans two byte tokens: the server streams the second one's chunk only, with both bytes.
    chunk = read({"content": "afé", "tokens": [999], "tokens_predicted": 4})
    assert tokenizer.decode(chunk.tokens) == "afé"


def test_sglang_output_ids_are_read_cumulative_or_incremental():
    cumulative, incremental = SglangReader(), SglangReader()
    assert [cumulative({"output_ids": ids, "meta_info": {"completion_tokens": len(ids)}}).tokens for ids in ([5], [5, 6, 7])] == [[5], [6, 7]]
    assert [incremental({"output_ids": ids, "meta_info": {"completion_tokens": n}}).tokens for ids, n in (([5], 1), ([6, 7], 3))] == [[5], [6, 7]]


def _wait(predicate, timeout: float = 10.0) -> bool:
    from tests.support import wait_until

    return wait_until(predicate, timeout, 0.02)


def test_a_config_model_table_names_its_engine(tmp_path):
    from kiln.protocol.model_config import ConfigError, load_config

    path = tmp_path / "kiln.toml"
    path.write_text('[[models]]\nid = "big"\nsource = "org/Big-Model"\nupstream = "http://10.0.0.5:8000"\nupstream_kind = "vllm"\nmax_batch = 64\n')
    settings = load_config(path).model("big").worker_settings()
    assert (settings["engine"], settings["upstream"], settings["upstream_kind"], settings["max_batch"]) == ("upstream", "http://10.0.0.5:8000", "vllm", 64)
    path.write_text('[[models]]\nid = "big"\nsource = "m.gguf"\nupstream = "http://h:1"\nupstream_kind = "tgi"\n')
    with pytest.raises(ConfigError, match="upstream_kind must be one of"):
        load_config(path)


def test_kiln_worker_refuses_upstream_without_a_url():
    from click.testing import CliRunner

    from kiln.worker.cli import main

    result = CliRunner().invoke(main, ["--engine", "upstream"], env={"KILN_UPSTREAM": ""})
    assert result.exit_code == 2 and "--upstream" in result.output
    result = CliRunner().invoke(main, ["--engine", "upstream", "--upstream", "localhost:8080"])
    assert result.exit_code == 2 and "http://" in result.output


def test_requests_on_an_engine_that_stops_answering_end_with_503(upstream):
    service, fake = upstream("llama-server", delay_s=30)  # accepts the request, then says nothing
    inbox = Inbox()
    service.generate(Generate("r", "resp_r", ask()), inbox)
    assert _wait(lambda: len(fake.bodies) == 1)
    fake.healthy = False  # and its health probe fails from now on
    failed = inbox.final("r", timeout=15)
    assert isinstance(failed, Failed) and failed.http_status == 503 and "engine" in failed.message
    assert not service.scheduler.healthy
    fake.healthy = True
    assert _wait(lambda: service.scheduler.healthy)  # back with the engine
