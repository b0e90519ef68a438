"""The worker's request handling: render, tokenize, schedule, and stream events back.

``GenerationService`` is transport-agnostic: the server hands it protocol messages and an
``emit`` callable, and it answers through ``emit`` only. It never blocks the I/O thread: the
message handlers only check cheap fields and queue the preparation (rendering, tokenizing,
grammar setup) on a small bounded pool (preparation.py); generation runs on the scheduler's
thread, which calls back per token.

Errors sent to the gateway are fixed sentences; the exceptions behind them go to the log, since
their text is about our code, not about the client's request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kiln.protocol import Compact, Compacted, CountTokens, Done, Event, Failed, Generate, TokenCount
from kiln.protocol.events import WorkerEvent
from kiln.protocol.request import FunctionCall, FunctionCallOutput, GenerateRequest, InputItem, Message, Reasoning
from kiln.protocol.usage import Usage

from . import compaction
from .engine.types import EngineRequest, QueueFull, SamplingParams, Step
from .output.events import OutputAssembler, logprob_entry
from .preparation import Preparer
from .prompt import RenderOptions, render
from .prompt_bound import PromptBound
from .request_params import engine_params

log = logging.getLogger("kiln.worker.service")

Emit = Callable[[Any], None]

RENDER_FAILED = "The input could not be rendered with the model's chat template."
GENERATION_FAILED = "The model failed while generating this response."
ENGINE_UNAVAILABLE = "The model's engine is not answering; retry shortly."


@dataclass
class ServiceConfig:
    model_id: str
    context_window: int
    default_max_output_tokens: int = 4096
    prepare_threads: int = 2  # threads rendering and tokenizing requests
    prepare_queue: int = 64  # requests that may wait for one of them; more get 503


class GenerationService:
    def __init__(
        self,
        *,
        tokenizer: Any,
        scheduler: Any,
        config: ServiceConfig,
        render_options: RenderOptions | None = None,
        router_factory: Callable[[GenerateRequest, str], Any] | None = None,
        constraint_factory: Callable[[GenerateRequest], list[Any]] | None = None,  # logits processors, or an upstream's EngineConstraint
        tools_prompt: Callable[[GenerateRequest], str | None] | None = None,
        preparer: Preparer | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.config = config
        self.render_options = render_options or RenderOptions()
        self.router_factory = router_factory
        self.constraint_factory = constraint_factory
        self.tools_prompt = tools_prompt
        self.bound = PromptBound(tokenizer)
        self.preparer = preparer or Preparer(config.prepare_threads, config.prepare_queue)
        self._handles: dict[str, int] = {}
        self._preparing: set[str] = set()
        self._dropped: set[str] = set()  # cancelled while being prepared: never submitted
        self._lock = threading.Lock()

    # -- prompt ----------------------------------------------------------------------------------
    def prompt_text(self, request: GenerateRequest) -> str:
        tools_prompt = self.tools_prompt(request) if self.tools_prompt else None
        return render(request, self.tokenizer, self.render_options, tools_prompt=tools_prompt)

    def prompt_tokens(self, request: GenerateRequest) -> list[int]:
        tokens: list[int] = self.tokenizer.encode(self.prompt_text(request))
        return tokens

    def _render(self, req_id: str, request: GenerateRequest, emit: Emit) -> str | None:
        """The prompt text, or None after answering Failed (a template that raises is the
        client's input problem)."""
        try:
            return self.prompt_text(request)
        except Exception:
            log.warning("could not render request %s", req_id, exc_info=True)
            emit(Failed(req_id, 400, "invalid_prompt", RENDER_FAILED))
            return None

    def _provably_longer(self, text: str, limit: int) -> int | None:
        """A lower bound on the tokens of text when it proves more than limit (see prompt_bound)."""
        return self.bound.exceeds(text, limit)

    # -- messages (called on the I/O thread: queue the work, never do it) -----------------------
    def generate(self, message: Generate, emit: Emit) -> None:
        # The request's ranges were checked when it was decoded (GenerateRequest.from_wire).
        self._prepare(message.req_id, lambda: self._generate(message, emit), emit, self._weight(message.request))

    def count(self, message: CountTokens, emit: Emit) -> None:
        self._prepare(message.req_id, lambda: self._count(message, emit), emit, self._weight(message.request))

    def compact(self, message: Compact, emit: Emit) -> None:
        self._prepare(message.req_id, lambda: self._compact(message, emit), emit, self._weight(message.request))

    def cancel(self, req_id: str) -> None:
        with self._lock:
            handle = self._handles.get(req_id)
            if handle is None and req_id in self._preparing:
                self._dropped.add(req_id)  # dropped when its preparation ends
        if handle is not None:
            self.scheduler.cancel(handle)

    def stats(self) -> dict[str, Any]:
        stats = dict(self.scheduler.stats())
        with self._lock:
            stats["preparing"] = len(self._preparing)
        return stats

    def stop(self) -> None:
        self.preparer.stop()

    def _weight(self, request: GenerateRequest) -> int:
        """What preparing a request weighs on the pool: its characters, except for one provably
        longer than the window (then refused untokenized, 400, never 503 for the pool's load)."""
        chars = request_weight(request)
        most = self.bound.max_bytes
        return 0 if most is not None and chars > self.config.context_window * most else chars

    # -- preparation (on the preparation threads) ------------------------------------------------
    def _prepare(self, req_id: str, job: Callable[[], None], emit: Emit, weight: int = 0) -> None:
        with self._lock:
            self._preparing.add(req_id)

        def run() -> None:
            try:
                with self._lock:
                    dropped = req_id in self._dropped
                if not dropped:
                    job()
            except Exception:  # a bug of ours fails this request, never the worker
                log.exception("preparing request %s failed", req_id)
                emit(Failed(req_id, 500, "server_error", "The worker could not prepare this request."))
            finally:
                with self._lock:
                    self._preparing.discard(req_id)
                    self._dropped.discard(req_id)

        if not self.preparer.submit(run, weight):
            with self._lock:
                self._preparing.discard(req_id)
            emit(Failed(req_id, 503, "server_is_overloaded", "The worker is busy preparing other requests; retry shortly."))

    def _submit(self, req_id: str, request: EngineRequest, emit: Emit) -> None:
        """Hand a prepared request to the scheduler, unless it was cancelled meanwhile."""
        with self._lock:
            if req_id in self._dropped:
                return  # the gateway already forgot it
            try:
                self._handles[req_id] = self.scheduler.submit(request)
                return
            except QueueFull as exc:
                refusal = str(exc) or "The worker's queue is full; retry shortly."
        emit(Failed(req_id, 503, "server_is_overloaded", refusal))

    def _count(self, message: CountTokens, emit: Emit) -> None:
        req_id, window = message.req_id, self.config.context_window
        text = self._render(req_id, message.request, emit)
        if text is None:
            return
        lower = self._provably_longer(text, window)
        if lower is not None:
            emit(Failed(req_id, 400, "context_length_exceeded", f"The input is at least {lower} tokens, more than the model's context window of {window} tokens.", "input"))
            return
        emit(TokenCount(req_id, len(self.tokenizer.encode(text))))

    def _compact(self, message: Compact, emit: Emit) -> None:
        """Plan the split, generate the summary on the scheduler, answer Compacted."""
        req_id, request = message.req_id, message.request
        items = request.input
        window = self.config.context_window

        def refuse(reason: str) -> None:
            emit(Failed(req_id, 400, "context_length_exceeded", f"Compaction cannot shorten this input: {reason}.", "input"))

        text = self._render(req_id, request, emit)
        if text is None:
            return
        lower = self._provably_longer(text, window)
        if lower is not None:
            return refuse(f"the history is at least {lower} tokens, longer than the context window of {window}")
        try:
            before = len(self.tokenizer.encode(text))
            del text
            if before > window:
                return refuse(f"the history is {before} tokens, longer than the context window of {window}")
            bare = replace(request, instructions=None, tools=())

            def count(part: list[InputItem]) -> int:
                return len(self.prompt_tokens(replace(bare, input=tuple(part))))

            split = compaction.plan(items, message.keep_tokens, count)
            if not split.summarized:  # nothing to summarize: all retained, no generation
                emit(Compacted(req_id, "", split.kept, split.retained, before, before, Usage()))
                return
            summarized = [items[i] for i in split.summarized]
            budget = compaction.summary_budget(count(summarized), count([compaction.summary_message("")]), message.max_output_tokens)
            summary_request = compaction.summary_request(request.model, summarized, budget)
            prompt = self.prompt_tokens(summary_request)
        except compaction.CompactionRefused as exc:
            return refuse(str(exc))
        except Exception:
            log.warning("could not render compaction of %s", req_id, exc_info=True)
            emit(Failed(req_id, 400, "invalid_prompt", RENDER_FAILED))
            return
        if len(prompt) >= window:
            return refuse("the part to summarize does not fit the context window")

        def summarize(budget: int, spent: Usage | None) -> EngineRequest:
            def finished(summary: str, usage: Usage) -> None:
                if spent is not None:
                    usage += spent
                compacted = [items[i] for i in split.kept] + [compaction.summary_message(summary)] + [items[i] for i in split.retained]
                after = len(self.prompt_tokens(replace(request, input=tuple(compacted))))
                if after >= before and spent is None:
                    # One retry, tighter by the excess (and at most half the first budget),
                    # from the preparation threads: never resubmit from the scheduler's callback.
                    tighter = compaction.retry_budget(budget, usage.output_tokens, after - before)
                    if tighter is not None:
                        retry = summarize(tighter, usage)
                        self._prepare(req_id, lambda: self._submit(req_id, retry, emit), emit)
                        return
                if after >= before:
                    return refuse(f"the summary does not shorten the context ({after} >= {before} tokens)")
                if after >= window:
                    return refuse("the summary does not fit the context window")
                emit(Compacted(req_id, summary, split.kept, split.retained, before, after, usage))

            collector = _Collector(self, req_id, len(prompt), finished, emit)
            params = SamplingParams(temperature=0.0, max_tokens=max(1, min(budget, window - len(prompt))))
            return EngineRequest(prompt=prompt, params=params, stop_tokens=frozenset(self.tokenizer.eos_token_ids), on_step=collector.on_step, cache_scope=request.cache_scope)

        self._submit(req_id, summarize(budget, None), emit)

    def _generate(self, message: Generate, emit: Emit) -> None:
        req_id, request = message.req_id, message.request
        window = self.config.context_window
        text = self._render(req_id, request, emit)
        if text is None:
            return
        # A prompt of window tokens or more does not fit: refuse the provably long ones untokenized.
        lower = self._provably_longer(text, window - 1)
        if lower is not None:
            emit(Failed(req_id, 400, "context_length_exceeded", f"The input is at least {lower} tokens, which does not fit the model's context window of {window} tokens.", "input"))
            return
        prompt = self.tokenizer.encode(text)
        if not prompt:
            emit(Failed(req_id, 400, "invalid_prompt", "The input renders to an empty prompt.", "input"))
            return
        if len(prompt) >= window:
            emit(Failed(req_id, 400, "context_length_exceeded", f"The input is {len(prompt)} tokens, which does not fit the model's context window of {window} tokens.", "input"))
            return
        params = engine_params(request.sampling, window - len(prompt), self.config.default_max_output_tokens)
        try:
            processors = self.constraint_factory(request) if self.constraint_factory else []
        except ValueError as exc:  # a grammar that cannot compile; its message names the problem
            emit(Failed(req_id, 400, "invalid_request_error", str(exc), "text.format"))
            return
        try:
            router = self.router_factory(request, text) if self.router_factory else None
            del text  # the prompt may be large: keep only its tokens from here on
            run = _Run(self, req_id, emit, request, params, len(prompt), router)
        except Exception:  # a broken parser setup fails this request, not the worker
            log.exception("could not prepare output parsing")
            emit(Failed(req_id, 500, "server_error", "The output parser could not be set up for this request."))
            return
        engine_request = EngineRequest(
            prompt=prompt,
            params=params,
            stop_tokens=frozenset(self.tokenizer.eos_token_ids),
            on_step=run.on_step,
            on_progress=run.on_progress,
            logits_processors=processors,
            cache_key=request.cache_key,
            cache_scope=request.cache_scope,
        )
        run.request = engine_request
        self._submit(req_id, engine_request, emit)

    def _forget(self, req_id: str) -> None:
        with self._lock:
            self._handles.pop(req_id, None)


def request_weight(request: GenerateRequest) -> int:
    """Characters a request's preparation renders and tokenizes: what its cost grows with."""
    total = len(request.instructions or "") + len(request.raw_prompt or "")
    for item in request.input:
        if isinstance(item, Message):
            total += sum(len(part.text) for part in item.content)
        elif isinstance(item, FunctionCall):
            total += len(item.arguments)
        elif isinstance(item, FunctionCallOutput):
            total += len(item.output)
        elif isinstance(item, Reasoning):
            total += len(item.text)
    return total


class _Run:
    """One request's output state, driven on the scheduler thread by ``on_step``."""

    def __init__(self, service: GenerationService, req_id: str, emit: Emit, request: GenerateRequest, params: SamplingParams, prompt_len: int, router: Any) -> None:
        self.service = service
        self.req_id = req_id
        self.emit = emit
        self.prompt_len = prompt_len
        self.request: EngineRequest | None = None
        tok = service.tokenizer
        self.decoder = tok.stream_decoder()
        self._pending: list[WorkerEvent] = []  # this token's events, sent together
        self.assembler = OutputAssembler(
            self._pending.append,
            router=router,
            want_logprobs=params.logprobs,
            namespaces=request.namespaces(),
            max_tool_calls=request.max_tool_calls,
        )
        self.want_logprobs = params.logprobs
        self.failed = False

    def on_step(self, step: Step) -> None:
        if self.failed:
            return  # already answered Failed; the scheduler's terminal step changes nothing
        try:
            self._on_step(step)
            self._flush()
        except Exception:  # never let one request's bug stop the scheduler thread
            log.exception("output assembly failed")
            self.failed = True
            self.service._forget(self.req_id)
            self.emit(Failed(self.req_id, 500, "server_error", "The response could not be assembled."))
            raise  # the scheduler then ends this request

    def on_progress(self) -> None:
        """A chunk of the prompt is prefilled: an Event with no events tells the gateway this
        request is alive (its between-events deadline would otherwise run during a long prefill),
        and its usage the prompt's size (a warm-up answered before its prefill ends reports it)."""
        if not self.failed:
            self.emit(Event(self.req_id, [], self.usage()))

    def usage(self) -> Usage:
        """Usage so far: what Done would report if the request ended now."""
        return Usage(
            input_tokens=self.prompt_len,
            cached_tokens=self.request.cached_tokens if self.request is not None else 0,
            output_tokens=self.assembler.output_tokens,
            reasoning_tokens=self.assembler.reasoning_tokens,
        )

    def _flush(self) -> None:
        if self._pending:
            self.emit(Event(self.req_id, list(self._pending), self.usage()))
            self._pending.clear()

    def _on_step(self, step: Step) -> None:
        reason = step.finish_reason
        if step.token is not None and reason != "stop":
            text = self.decoder.feed(step.token)
            logprob = None
            if self.want_logprobs and step.logprob is not None:
                tok = self.service.tokenizer
                top = [(tok.decode([t]), lp) for t, lp in (step.top_logprobs or [])]
                logprob = logprob_entry(tok.decode([step.token]), step.logprob, top)
            self.assembler.add_token(text, logprob)
        if reason is None:
            return
        self.service._forget(self.req_id)
        if reason == "cancelled":
            return  # the gateway already forgot this request
        if reason == "error":
            log.error("request %s failed in the engine: %s", self.req_id, step.error)
            self._flush()
            if step.unavailable:
                self.emit(Failed(self.req_id, 503, "server_is_overloaded", ENGINE_UNAVAILABLE))
            else:
                self.emit(Failed(self.req_id, 500, "server_error", GENERATION_FAILED))
            return
        tail = self.decoder.flush()
        if tail:
            self.assembler.add_token(tail)
            self.assembler.output_tokens -= 1
        status, incomplete = self.assembler.finish(reason)
        self._flush()
        self.emit(Done(self.req_id, status, self.usage(), incomplete))


class _Collector:
    """Collects a whole generation as text (the compaction summary)."""

    def __init__(self, service: GenerationService, req_id: str, prompt_len: int, finished: Callable[[str, Usage], None], emit: Emit) -> None:
        self.service = service
        self.req_id = req_id
        self.prompt_len = prompt_len
        self.finished = finished
        self.emit = emit
        self.decoder = service.tokenizer.stream_decoder()
        self.parts: list[str] = []
        self.tokens = 0

    def on_step(self, step: Step) -> None:
        if step.token is not None and step.finish_reason != "stop":
            self.parts.append(self.decoder.feed(step.token))
            self.tokens += 1
        if step.finish_reason is None:
            return
        self.service._forget(self.req_id)
        if step.finish_reason == "cancelled":
            return
        if step.finish_reason == "error":
            log.error("summary for %s failed in the engine: %s", self.req_id, step.error)
            self.emit(Failed(self.req_id, 500, "server_error", "The model failed while generating the summary."))
            return
        self.parts.append(self.decoder.flush())
        usage = Usage(input_tokens=self.prompt_len, output_tokens=self.tokens)
        try:
            self.finished("".join(self.parts).strip(), usage)
        except Exception:
            log.exception("compaction of %s failed", self.req_id)
            self.emit(Failed(self.req_id, 500, "server_error", "The compacted input could not be built."))

