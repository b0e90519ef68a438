"""The worker's request handling: render, tokenize, schedule, and stream events back.

``GenerationService`` is transport-agnostic: the server hands it protocol messages and an
``emit`` callable, and it answers through ``emit`` only. It never blocks the I/O thread on the
model; generation runs on the scheduler's thread, which calls back per token.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.protocol import Compact, Compacted, CountTokens, Done, Event, Failed, Generate, TokenCount

from . import compaction
from .detokenize import IncrementalDecoder
from .engine.types import EngineRequest, QueueFull, SamplingParams, Step
from .output.events import OutputAssembler, logprob_entry
from .prompt import RenderOptions, render

log = logging.getLogger("kiln.worker.service")

Emit = Callable[[Any], None]


@dataclass
class ServiceConfig:
    model_id: str
    context_window: int
    default_max_output_tokens: int = 4096


class PromptTooLong(Exception):
    pass


class GenerationService:
    def __init__(
        self,
        *,
        tokenizer: Any,
        scheduler: Any,
        config: ServiceConfig,
        render_options: RenderOptions | None = None,
        router_factory: Callable[[dict, str], Any] | None = None,
        constraint_factory: Callable[[dict], list] | None = None,
        tools_prompt: Callable[[dict], str | None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.config = config
        self.render_options = render_options or RenderOptions()
        self.router_factory = router_factory
        self.constraint_factory = constraint_factory
        self.tools_prompt = tools_prompt
        self._handles: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- prompt ----------------------------------------------------------------------------------
    def prompt_text(self, body: dict) -> str:
        tools_prompt = self.tools_prompt(body) if self.tools_prompt else None
        return render(body, self.tokenizer, self.render_options, tools_prompt=tools_prompt)

    def prompt_tokens(self, body: dict) -> list[int]:
        return self.tokenizer.encode(self.prompt_text(body))

    # -- messages --------------------------------------------------------------------------------
    def count(self, message: CountTokens, emit: Emit) -> None:
        try:
            tokens = self.prompt_tokens(message.body)
        except Exception as exc:  # a template that raises is the client's input problem
            emit(Failed(message.req_id, 400, "invalid_prompt", f"The input could not be rendered: {exc}"))
            return
        emit(TokenCount(message.req_id, len(tokens)))

    def compact(self, message: Compact, emit: Emit) -> None:
        """Plan the split, generate the summary on the scheduler, answer Compacted."""
        req_id, body = message.req_id, message.body
        items = body.get("input") or []
        window = self.config.context_window

        def refuse(reason: str) -> None:
            emit(Failed(req_id, 400, "context_length_exceeded", f"Compaction cannot shorten this input: {reason}.", "input"))

        try:
            before = len(self.prompt_tokens(body))
            if before > window:
                return refuse(f"the history is {before} tokens, longer than the context window of {window}")
            bare = {k: v for k, v in body.items() if k not in ("instructions", "tools")}
            split = compaction.plan(items, message.keep_tokens, lambda part: len(self.prompt_tokens({**bare, "input": part})))
            summary_request = compaction.summary_body([items[i] for i in split.summarized], message.max_output_tokens)
            prompt = self.prompt_tokens(summary_request)
        except compaction.CompactionRefused as exc:
            return refuse(str(exc))
        except Exception as exc:
            emit(Failed(req_id, 400, "invalid_prompt", f"The input could not be rendered: {exc}"))
            return
        if len(prompt) >= window:
            return refuse("the part to summarize does not fit the context window")

        def finished(summary: str, usage: dict) -> None:
            compacted = [items[i] for i in split.kept] + [compaction.summary_message(summary)] + [items[i] for i in split.retained]
            after = len(self.prompt_tokens({**body, "input": compacted}))
            if after >= before:
                return refuse(f"the summary does not shorten the context ({after} >= {before} tokens)")
            if after >= window:
                return refuse("the summary does not fit the context window")
            emit(Compacted(req_id, summary, split.kept, split.retained, before, after, usage))

        collector = _Collector(self, req_id, len(prompt), finished, emit)
        params = SamplingParams(temperature=0.0, max_tokens=min(message.max_output_tokens, window - len(prompt)))
        request = EngineRequest(prompt=prompt, params=params, stop_tokens=frozenset(self.tokenizer.eos_token_ids), on_step=collector.on_step)
        try:
            with self._lock:
                self._handles[req_id] = self.scheduler.submit(request)
        except QueueFull:
            emit(Failed(req_id, 503, "server_is_overloaded", "The worker's queue is full; retry shortly."))

    def cancel(self, req_id: str) -> None:
        with self._lock:
            handle = self._handles.get(req_id)
        if handle is not None:
            self.scheduler.cancel(handle)

    def stats(self) -> dict[str, Any]:
        return self.scheduler.stats()

    def generate(self, message: Generate, emit: Emit) -> None:
        req_id, body = message.req_id, message.body
        try:
            text = self.prompt_text(body)
            prompt = self.tokenizer.encode(text)
        except Exception as exc:
            emit(Failed(req_id, 400, "invalid_prompt", f"The input could not be rendered with the model's chat template: {exc}"))
            return
        window = self.config.context_window
        if len(prompt) >= window:
            emit(Failed(req_id, 400, "context_length_exceeded", f"The input is {len(prompt)} tokens, which does not fit the model's context window of {window} tokens.", "input"))
            return
        requested = body.get("max_output_tokens") or self.config.default_max_output_tokens
        max_tokens = min(requested, window - len(prompt))
        params = SamplingParams(
            temperature=float(1.0 if body.get("temperature") is None else body["temperature"]),
            top_p=float(1.0 if body.get("top_p") is None else body["top_p"]),
            max_tokens=max_tokens,
            top_logprobs=int(body.get("top_logprobs") or 0),
            logprobs=bool(body.get("top_logprobs")) or "message.output_text.logprobs" in (body.get("include") or []),
            seed=body.get("seed"),
        )
        try:
            processors = self.constraint_factory(body) if self.constraint_factory else []
        except ValueError as exc:
            emit(Failed(req_id, 400, "invalid_request_error", str(exc), "text.format"))
            return
        try:
            router = self.router_factory(body, text) if self.router_factory else None
            run = _Run(self, req_id, emit, body, params, len(prompt), router)
        except Exception as exc:  # a broken parser setup fails this request, not the worker
            log.exception("could not prepare output parsing")
            emit(Failed(req_id, 500, "server_error", f"output parsing could not be set up: {exc}"))
            return
        request = EngineRequest(
            prompt=prompt,
            params=params,
            stop_tokens=frozenset(self.tokenizer.eos_token_ids),
            on_step=run.on_step,
            logits_processors=processors,
            cache_key=body.get("prompt_cache_key"),
        )
        run.request = request
        try:
            with self._lock:
                self._handles[req_id] = self.scheduler.submit(request)
        except QueueFull:
            emit(Failed(req_id, 503, "server_is_overloaded", "The worker's queue is full; retry shortly."))

    def _forget(self, req_id: str) -> None:
        with self._lock:
            self._handles.pop(req_id, None)


class _Run:
    """One request's output state, driven on the scheduler thread by ``on_step``."""

    def __init__(self, service: GenerationService, req_id: str, emit: Emit, body: dict, params: SamplingParams, prompt_len: int, router: Any) -> None:
        self.service = service
        self.req_id = req_id
        self.emit = emit
        self.prompt_len = prompt_len
        self.request: EngineRequest | None = None
        tok = service.tokenizer
        self.decoder = IncrementalDecoder(tok.decode)
        self._pending: list[dict] = []  # this token's events, sent together
        self.assembler = OutputAssembler(
            self._pending.append,
            router=router,
            want_logprobs=params.logprobs,
            namespaces=_namespaces(body.get("tools") or []),
        )
        self.want_logprobs = params.logprobs

    def on_step(self, step: Step) -> None:
        try:
            self._on_step(step)
            self._flush()
        except Exception as exc:  # never let one request's bug stop the scheduler thread
            log.exception("output assembly failed")
            self.service._forget(self.req_id)
            self.emit(Failed(self.req_id, 500, "server_error", f"output assembly failed: {exc}"))
            raise

    def _flush(self) -> None:
        if self._pending:
            self.emit(Event(self.req_id, list(self._pending)))
            self._pending.clear()

    def _on_step(self, step: Step) -> None:
        reason = step.finish_reason
        if step.token is not None and reason != "stop":
            text = self.decoder.add(step.token)
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
            self._flush()
            self.emit(Failed(self.req_id, 500, "server_error", step.error or "generation failed"))
            return
        tail = self.decoder.flush()
        if tail:
            self.assembler.add_token(tail)
            self.assembler.output_tokens -= 1
        status, incomplete = self.assembler.finish(reason)
        cached = self.request.cached_tokens if self.request is not None else 0
        usage = {
            "input_tokens": self.prompt_len,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": self.assembler.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.assembler.reasoning_tokens},
        }
        self._flush()
        self.emit(Done(self.req_id, status, usage, incomplete))


class _Collector:
    """Collects a whole generation as text (the compaction summary)."""

    def __init__(self, service: GenerationService, req_id: str, prompt_len: int, finished: Callable[[str, dict], None], emit: Emit) -> None:
        self.service = service
        self.req_id = req_id
        self.prompt_len = prompt_len
        self.finished = finished
        self.emit = emit
        self.decoder = IncrementalDecoder(service.tokenizer.decode)
        self.parts: list[str] = []
        self.tokens = 0

    def on_step(self, step: Step) -> None:
        if step.token is not None and step.finish_reason != "stop":
            self.parts.append(self.decoder.add(step.token))
            self.tokens += 1
        if step.finish_reason is None:
            return
        self.service._forget(self.req_id)
        if step.finish_reason == "cancelled":
            return
        if step.finish_reason == "error":
            self.emit(Failed(self.req_id, 500, "server_error", step.error or "summary generation failed"))
            return
        self.parts.append(self.decoder.flush())
        usage = {"input_tokens": self.prompt_len, "output_tokens": self.tokens}
        try:
            self.finished("".join(self.parts).strip(), usage)
        except Exception as exc:
            self.emit(Failed(self.req_id, 500, "server_error", f"compaction failed: {exc}"))


def _namespaces(tools: list[dict]) -> dict[str, str]:
    return {fn["name"]: t["name"] for t in tools if t.get("type") == "namespace" for fn in t.get("tools", [])}
