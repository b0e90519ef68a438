"""The worker's service from a typed request, in process, against the scripted engine.

What a request says reaches the prompt, the sampler and the output items (instructions, tools
described with their namespace, ``tool_choice`` none, the legacy raw prompt, sampling, the
cache key), and a frame whose request is out of range is answered 400 naming the parameter
without the service seeing it. No process, no model: seconds.
"""

from __future__ import annotations

import time

import msgpack
import pytest

from kiln.protocol import Compact, Compacted, CountTokens, Done, Event, Failed, Generate, TokenCount
from kiln.protocol.request import ContentPart, FunctionCall, FunctionCallOutput, GenerateRequest, Message, Sampling, ToolChoice, ToolSpec
from kiln.worker.scripted import ByteTokenizer, ScriptedScheduler
from kiln.worker.server import read_frame
from kiln.worker.service import GenerationService, ServiceConfig
from kiln.worker.setup import model_extras

from .test_worker_reliability_service import WAIT, Inbox

CALL = '<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>'
READ = ToolSpec("read", {"type": "object", "properties": {"path": {"type": "string"}}}, "Reads a file.", namespace="fs")


class Recording(ScriptedScheduler):
    """The scripted engine, keeping what it was handed."""

    def __init__(self, reply: str) -> None:
        super().__init__(reply)
        self.submitted: list = []

    def submit(self, request):
        self.submitted.append(request)
        return super().submit(request)


@pytest.fixture
def engine():
    made: list[Recording] = []

    def make(reply: str = "Hello.") -> Recording:
        scheduler = Recording(reply)
        scheduler.start()
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.stop()


class Unconstrained:
    """No grammar compiler (the byte tokenizer has no llguidance view); no request here needs one."""

    def for_request(self, request: GenerateRequest) -> list:
        return []


def service(scheduler, window: int = 8192) -> GenerationService:
    tokenizer = ByteTokenizer()
    extras = model_extras(tokenizer, None, Unconstrained())  # the tool prompt and parser a ChatML-like template gets
    return GenerationService(tokenizer=tokenizer, scheduler=scheduler, config=ServiceConfig(model_id="m", context_window=window, default_max_output_tokens=40), **extras)


def user(text: str) -> Message:
    return Message("user", (ContentPart("input_text", text),))


def prompt_of(scheduler: Recording, index: int = 0) -> str:
    return bytes(t for t in scheduler.submitted[index].prompt if t < 256).decode()


def test_the_request_reaches_prompt_sampler_and_cache(engine):
    scheduler = engine()
    svc, inbox = service(scheduler), Inbox()
    request = GenerateRequest("m", input=(user("Read a.txt"),), instructions="Be brief.", tools=(READ,), sampling=Sampling(temperature=0.7, top_p=0.8, seed=11, top_logprobs=2, logprobs=True),
        cache_key="agent")
    svc.generate(Generate("r", "resp_r", request), inbox)
    assert isinstance(inbox.final("r"), Done)
    engine_request = scheduler.submitted[0]
    text = prompt_of(scheduler)
    assert "Be brief." in text and "Read a.txt" in text and '"name":"read"' in text and "Reads a file." in text
    params = engine_request.params
    assert (params.temperature, params.top_p, params.seed, params.top_logprobs, params.logprobs) == (0.7, 0.8, 11, 2, True)
    assert params.max_tokens == 40  # unset: the worker's default
    assert engine_request.cache_key == "agent"


def test_tool_choice_none_describes_no_tools_and_raw_prompt_skips_the_template(engine):
    scheduler = engine()
    svc, inbox = service(scheduler), Inbox()
    svc.generate(Generate("a", "resp_a", GenerateRequest("m", input=(user("hi"),), tools=(READ,), tool_choice=ToolChoice("none"))), inbox)
    svc.generate(Generate("b", "resp_b", GenerateRequest("m", input=(user("Once"),), raw_prompt="Once upon a", sampling=Sampling(max_output_tokens=3))), inbox)
    assert isinstance(inbox.final("a"), Done) and isinstance(inbox.final("b"), Done)
    prompts = {r.params.max_tokens: bytes(t for t in r.prompt if t < 256).decode() for r in scheduler.submitted}
    assert prompts[3] == "Once upon a"
    assert "read" not in prompts[40] and "hi" in prompts[40]


def test_a_namespaced_call_comes_back_with_its_namespace(engine):
    scheduler = engine(CALL)
    svc, inbox = service(scheduler), Inbox()
    history = (user("Read a.txt"), FunctionCall("c0", "read", '{"path": "b.txt"}'), FunctionCallOutput("c0", "B"), user("Now a.txt"))
    svc.generate(Generate("r", "resp_r", GenerateRequest("m", input=history, tools=(READ,), sampling=Sampling(max_output_tokens=200))), inbox)
    done = inbox.final("r")
    assert isinstance(done, Done) and done.status == "completed"
    items = [e["item"] for m in inbox.of("r") if isinstance(m, Event) for e in m.events if e["type"] == "response.output_item.done"]
    (call,) = [i for i in items if i["type"] == "function_call"]
    assert (call["name"], call["namespace"]) == ("read", "fs") and '"a.txt"' in call["arguments"]
    text = prompt_of(scheduler)
    assert "<tool_call>" in text and "<tool_response>\nB\n</tool_response>" in text  # the history, in markup


def test_max_output_tokens_is_capped_by_the_room_the_prompt_leaves(engine):
    scheduler = engine("x" * 100)
    svc, inbox = service(scheduler, window=64), Inbox()
    svc.generate(Generate("r", "resp_r", GenerateRequest("m", input=(user("hi"),), sampling=Sampling(max_output_tokens=1000))), inbox)
    done = inbox.final("r")
    assert isinstance(done, Done) and done.status == "incomplete"
    assert scheduler.submitted[0].params.max_tokens == 64 - len(scheduler.submitted[0].prompt)


def test_count_and_compact_from_the_typed_request(engine):
    scheduler = engine("short")
    svc, inbox = service(scheduler), Inbox()
    history = (Message("system", (ContentPart("input_text", "S"),)), user("one " * 40), Message("assistant", (ContentPart("output_text", "two " * 40),)), user("three"))
    request = GenerateRequest("m", input=history)
    svc.count(CountTokens("n", request), inbox)
    counted = inbox.final("n")
    assert isinstance(counted, TokenCount) and counted.input_tokens == len(svc.prompt_tokens(request))
    svc.compact(Compact("c", request, keep_tokens=10, max_output_tokens=50), inbox)
    deadline = time.monotonic() + WAIT
    while not any(isinstance(m, (Compacted, Failed)) for m in inbox.of("c")):
        assert time.monotonic() < deadline, "no compaction answer"
        time.sleep(0.01)
    (compacted,) = [m for m in inbox.of("c") if isinstance(m, (Compacted, Failed))]
    assert isinstance(compacted, Compacted), compacted
    assert compacted.summary == "short" and compacted.kept_indices == [0] and compacted.retained_indices == [3]
    assert compacted.input_tokens_after < compacted.input_tokens_before
    summary_prompt = prompt_of(scheduler, 0)
    assert "user: " + "one " * 10 in summary_prompt and "Summarize it." in summary_prompt


@pytest.mark.parametrize(("param", "value"), [("seed", -1), ("seed", 1.5), ("seed", 2**63), ("seed", "x"), ("top_logprobs", 100), ("max_output_tokens", 0)])
def test_a_bad_frame_is_a_400_naming_the_param_and_never_reaches_the_engine(engine, param, value):
    scheduler = engine()
    wire = {**GenerateRequest("m", input=(user("hi"),)).to_wire(), "sampling": {param: value}}
    answer = read_frame(msgpack.packb({"t": "Generate", "req_id": "bad", "response_id": "resp_bad", "request": wire}))
    assert isinstance(answer, Failed) and (answer.req_id, answer.http_status, answer.code, answer.param) == ("bad", 400, "invalid_request_error", param)
    assert answer.message.startswith(f"Invalid '{param}'") and "Error" not in answer.message
    assert scheduler.submitted == []
