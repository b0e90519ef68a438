"""The worker's request handling in process: bad requests fail alone, work never blocks the caller.

GenerationService gets protocol messages and answers through ``emit``. Here it runs on the
byte tokenizer with either the scripted engine or the real Scheduler over a tiny llama (whose
256-token vocabulary is the byte tokenizer's bytes), so the seed path reaches the real engine
in a second.
"""

from __future__ import annotations

import math
import threading
import time

import msgpack
import pytest

from kiln.protocol import Compact, CountTokens, Done, Event, Failed, Generate, TokenCount, decode, encode
from kiln.protocol.request import ContentPart, GenerateRequest, Message, Sampling
from kiln.protocol.usage import Usage
from kiln.worker.engine import Scheduler
from kiln.worker.preparation import Preparer
from kiln.worker.scripted import ByteTokenizer, ScriptedScheduler
from kiln.worker.server import read_frame
from kiln.worker.service import GenerationService, ServiceConfig

from .test_engine import tiny_llama

WAIT = 60  # seconds any single answer may take on a loaded CI machine


class Inbox:
    """Collects emitted messages per request; every wait is bounded."""

    def __init__(self) -> None:
        self.messages: list = []
        self.cv = threading.Condition()

    def __call__(self, message) -> None:
        with self.cv:
            self.messages.append(message)
            self.cv.notify_all()

    def of(self, req_id: str) -> list:
        with self.cv:
            return [m for m in self.messages if m.req_id == req_id]

    def final(self, req_id: str, timeout: float = WAIT):
        """The Done / Failed / TokenCount that ends req_id."""
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                for m in self.messages:
                    if m.req_id == req_id and isinstance(m, (Done, Failed, TokenCount)):
                        return m
                left = deadline - time.monotonic()
                assert left > 0, f"{req_id} got no final answer"
                self.cv.wait(left)


def body(text: str = "hi", **sampling) -> GenerateRequest:
    return GenerateRequest("m", input=(Message("user", (ContentPart("input_text", text),)),), sampling=Sampling(**sampling))


def deliver(svc: GenerationService, inbox, req_id: str, text: str = "hi", **sampling) -> None:
    """A Generate frame as a gateway might send it, sampling values unchecked, through what the
    worker's server does with a frame (a request out of range is answered, never started)."""
    wire = {**body(text).to_wire(), "sampling": sampling}
    message = read_frame(msgpack.packb({"t": "Generate", "req_id": req_id, "response_id": "resp_" + req_id, "request": wire}))
    if isinstance(message, Failed):
        inbox(message)
    else:
        svc.generate(message, inbox)


def service(scheduler, *, window: int = 8192, **kw) -> GenerationService:
    return GenerationService(tokenizer=ByteTokenizer(), scheduler=scheduler, config=ServiceConfig(model_id="m", context_window=window), **kw)


@pytest.fixture
def scripted():
    s = ScriptedScheduler("Hello there.", delay_s=0.001)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def real_engine():
    s = Scheduler(tiny_llama(), max_batch=8, cache_bytes=0)
    s.start()
    yield s
    s.stop()


@pytest.mark.parametrize("seed", ["x", -1, 1.5, math.nan, True, 2**63])
def test_bad_seed_among_concurrent_requests_fails_alone_on_the_real_engine(real_engine, seed):
    svc = service(real_engine)
    inbox = Inbox()
    ids = ["good-0", "bad", "good-1", "good-2"]
    for req_id in ids:
        extra = {"seed": seed} if req_id == "bad" else {"seed": 7}
        deliver(svc, inbox, req_id, f"prompt {req_id}", temperature=0.8, max_output_tokens=6, **extra)
    bad = inbox.final("bad")
    assert isinstance(bad, Failed) and (bad.http_status, bad.code, bad.param) == (400, "invalid_request_error", "seed")
    assert bad.message.startswith("Invalid 'seed'") and "Error" not in bad.message
    for req_id in ids:
        if req_id != "bad":
            done = inbox.final(req_id)
            assert isinstance(done, Done) and done.usage.output_tokens == 6
    assert real_engine.stats()["active"] == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", math.inf), ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"), ("top_p", 0), ("top_p", math.nan),
     ("top_logprobs", 21), ("top_logprobs", 1.0), ("max_output_tokens", 0), ("max_output_tokens", "9")],
)  # fmt: skip
def test_bad_sampling_values_are_400_naming_the_param(scripted, field, value):
    svc = service(scripted)
    inbox = Inbox()
    deliver(svc, inbox, "r", **{field: value})
    failed = inbox.final("r")
    assert isinstance(failed, Failed) and (failed.http_status, failed.code, failed.param) == (400, "invalid_request_error", field)
    assert failed.message.startswith(f"Invalid '{field}'")


def test_every_event_carries_the_usage_done_would_report(scripted):
    svc = service(scripted)
    inbox = Inbox()
    svc.generate(Generate("r", "resp_r", body(max_output_tokens=5)), inbox)
    done = inbox.final("r")
    events = [m for m in inbox.of("r") if isinstance(m, Event)]
    assert isinstance(done, Done) and done.status == "incomplete"
    counts = [e.usage.output_tokens for e in events]
    assert counts == sorted(counts) and counts[-1] == done.usage.output_tokens == 5
    assert events[-1].usage == done.usage
    assert events[0].usage.input_tokens == done.usage.input_tokens > 0


def test_event_usage_on_the_wire_is_optional_both_ways():
    usage = Usage(input_tokens=3, output_tokens=1)
    event = Event("r", [{"type": "response.output_text.delta", "delta": "a"}], usage)
    assert decode(encode(event)) == event
    old_worker = msgpack.packb({"t": "Event", "req_id": "r", "events": []})
    assert decode(old_worker) == Event("r", [], None)


class Gate:
    """A tools_prompt hook that holds rendering until released: preparation in progress."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, body: dict) -> None:
        self.entered.set()
        assert self.release.wait(WAIT)
        return None


def test_slow_preparation_does_not_block_the_caller_and_cancel_drops_it(scripted):
    gate = Gate()
    svc = service(scripted, tools_prompt=gate, preparer=Preparer(threads=1, depth=4))
    inbox = Inbox()
    svc.generate(Generate("slow", "resp_slow", body()), inbox)  # returns while rendering is held
    assert gate.entered.wait(WAIT)
    svc.generate(Generate("queued", "resp_q", body()), inbox)
    svc.cancel("slow")
    svc.cancel("queued")
    assert svc.stats()["preparing"] == 2
    gate.release.set()
    svc.generate(Generate("after", "resp_a", body()), inbox)
    assert isinstance(inbox.final("after"), Done)
    assert inbox.of("slow") == [] and inbox.of("queued") == []  # cancelled: nothing is emitted
    deadline = time.monotonic() + WAIT
    while svc.stats()["preparing"]:  # the last job's bookkeeping may trail its answer
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert scripted.stats()["active"] == 0


def test_full_preparation_queue_answers_503(scripted):
    gate = Gate()
    svc = service(scripted, tools_prompt=gate, preparer=Preparer(threads=1, depth=1))
    inbox = Inbox()
    svc.generate(Generate("a", "resp_a", body()), inbox)
    assert gate.entered.wait(WAIT)
    svc.generate(Generate("b", "resp_b", body()), inbox)  # waits in the queue
    svc.count(CountTokens("c", body()), inbox)  # no room
    refused = inbox.final("c")
    assert isinstance(refused, Failed) and (refused.http_status, refused.code) == (503, "server_is_overloaded")
    gate.release.set()
    assert isinstance(inbox.final("a"), Done) and isinstance(inbox.final("b"), Done)


def test_preparation_past_its_weight_answers_503_and_an_idle_pool_takes_any(scripted):
    """Issue 30 item 8: the preparation queue is bounded in work, not only in jobs: large prompts
    beyond ``max_weight`` characters waiting or running are refused at once (the gateway retries
    elsewhere or answers 503 with Retry-After) instead of piling up until heartbeats starve."""
    gate = Gate()
    svc = service(scripted, window=100_000, tools_prompt=gate, preparer=Preparer(threads=1, depth=64, max_weight=1000))
    inbox = Inbox()
    svc.generate(Generate("a", "resp_a", body("x" * 600)), inbox)
    assert gate.entered.wait(WAIT)
    svc.generate(Generate("b", "resp_b", body("x" * 300)), inbox)  # 900 of 1000: waits
    svc.generate(Generate("c", "resp_c", body("x" * 300)), inbox)  # 1200: refused
    refused = inbox.final("c")
    assert isinstance(refused, Failed) and (refused.http_status, refused.code) == (503, "server_is_overloaded")
    gate.release.set()
    assert isinstance(inbox.final("a"), Done) and isinstance(inbox.final("b"), Done)
    deadline = time.monotonic() + WAIT
    while svc.preparer.weight():  # the bookkeeping may trail the answer
        assert time.monotonic() < deadline
        time.sleep(0.01)
    svc.generate(Generate("d", "resp_d", body("x" * 5000)), inbox)  # heavier than it all, but alone
    assert isinstance(inbox.final("d"), Done)


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += len(text)
        return super().encode(text)


def test_huge_prompt_is_refused_without_tokenizing(scripted):
    tok = CountingTokenizer()
    svc = GenerationService(tokenizer=tok, scheduler=scripted, config=ServiceConfig(model_id="m", context_window=4096))
    inbox = Inbox()
    huge = body("x" * (10 << 20))
    svc.generate(Generate("g", "resp_g", huge), inbox)
    svc.count(CountTokens("n", huge), inbox)
    svc.compact(Compact("c", huge, keep_tokens=100, max_output_tokens=50), inbox)
    for req_id in ("g", "n", "c"):
        failed = inbox.final(req_id)
        assert isinstance(failed, Failed) and (failed.http_status, failed.code, failed.param) == (400, "context_length_exceeded", "input")
    assert tok.encoded == 0
    # Just over the window but not provably so by the bound: tokenized, then refused exactly.
    svc.generate(Generate("near", "resp_n", body("y" * 4096)), inbox)
    near = inbox.final("near")
    assert isinstance(near, Failed) and near.code == "context_length_exceeded" and tok.encoded > 0
    svc.count(CountTokens("ok", body("z" * 100)), inbox)
    assert inbox.final("ok").input_tokens > 100


def test_template_failure_is_a_fixed_400(scripted):
    class Broken(ByteTokenizer):
        def apply_chat_template(self, messages, **kw):
            raise TypeError("secret internals")

    svc = GenerationService(tokenizer=Broken(), scheduler=scripted, config=ServiceConfig(model_id="m", context_window=4096))
    inbox = Inbox()
    svc.generate(Generate("r", "resp_r", body()), inbox)
    failed = inbox.final("r")
    assert isinstance(failed, Failed) and (failed.http_status, failed.code) == (400, "invalid_prompt")
    assert "secret" not in failed.message and "TypeError" not in failed.message


def test_output_assembly_failure_ends_only_its_request(real_engine):
    class Exploding:
        """A router whose feed fails on the third token."""

        def __init__(self) -> None:
            self.fed = 0

        def feed(self, text):
            self.fed += 1
            if self.fed == 3:
                raise RuntimeError("parser bug")
            return []

        def finish(self):
            return [], []

    svc = service(real_engine, router_factory=lambda body, text: Exploding() if "explode" in text else None)
    inbox = Inbox()
    for req_id in ("a", "explode", "b"):
        svc.generate(Generate(req_id, "resp_" + req_id, body(req_id, temperature=0, max_output_tokens=8)), inbox)
    failed = inbox.final("explode")
    assert isinstance(failed, Failed) and failed.http_status == 500 and "parser bug" not in failed.message
    assert isinstance(inbox.final("a"), Done) and isinstance(inbox.final("b"), Done)
    # One answer only: the scheduler ended the request, nothing followed the Failed.
    assert [type(m) for m in inbox.of("explode")] == [Failed]
    assert real_engine.stats()["active"] == 0


def test_cancel_of_a_running_request_emits_nothing(real_engine):
    svc = service(real_engine)
    inbox = Inbox()
    svc.generate(Generate("long", "resp_l", body(temperature=0, max_output_tokens=100_000)), inbox)
    deadline = time.monotonic() + WAIT
    while not inbox.of("long"):
        assert time.monotonic() < deadline, "no first event"
        time.sleep(0.01)
    svc.cancel("long")
    deadline = time.monotonic() + WAIT
    while real_engine.stats()["active"]:
        assert time.monotonic() < deadline, "cancel did not end the request"
        time.sleep(0.01)
    assert not any(isinstance(m, (Done, Failed)) for m in inbox.of("long"))
