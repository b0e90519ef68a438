"""Each engine's streamed completion chunks, read back as token ids, finish and usage.

A reader is fed the JSON of one server-sent event at a time and answers a ``Chunk``: the new
token ids (with their logprobs when asked), the finish reason once there is one, and the
engine's own counts when it reports them. Field names follow the engines' sources and docs
(see requests.py for the versions); tests/worker/test_upstream_exchanges.py replays recorded
exchanges of each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .requests import Kind

TopLogprobs = list[tuple[int, float]]


class UpstreamError(Exception):
    """The engine refused or broke off a request. ``status``: its HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Chunk:
    tokens: list[int] = field(default_factory=list)
    # Per token (same length as tokens) when logprobs were asked for and the engine sent them.
    logprobs: list[tuple[float, TopLogprobs]] | None = None
    finish: str | None = None  # "stop" | "length"
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None


def reader(kind: Kind, encode: Callable[[str], list[int]]) -> Callable[[dict[str, Any]], Chunk]:
    """A fresh reader for one request's stream. ``encode``: the model's tokenizer, for the one
    case an engine streams text without its token ids (see LlamaServerReader)."""
    if kind == "llama-server":
        return LlamaServerReader(encode)
    if kind == "vllm":
        return VllmReader()
    if kind == "sglang":
        return SglangReader()
    raise ValueError(f"unknown upstream kind {kind!r}")


def _error(event: dict[str, Any]) -> None:
    error = event.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else error
        code = error.get("code") if isinstance(error, dict) else None
        raise UpstreamError(f"the engine reported an error: {message}", code if isinstance(code, int) else 0)


def _finish(value: Any) -> str | None:
    if value in (None, ""):
        return None
    if value in ("length", "limit"):
        return "length"
    if value in ("stop", "eos", "word"):
        return "stop"
    raise UpstreamError(f"the engine ended the request: {value}")  # "abort" and the like


class LlamaServerReader:
    """llama-server ``/completion`` with ``return_tokens``: a chunk per sampled token whose text
    is complete UTF-8 (``tokens`` [id], ``tokens_predicted``), then a final chunk (``stop``
    true, ``stop_type`` eos|limit|word, ``timings.cache_n`` / ``prompt_n`` / ``predicted_n``).

    A token that ends inside a UTF-8 character is held back by the server and never streamed on
    its own: the next chunk's text covers both but names only its own id. The gap shows in
    ``tokens_predicted``; the chunk's text is then re-tokenized, which gives the same text (and
    so the same parsed output) in possibly different ids."""

    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self.encode = encode
        self.seen = 0

    def __call__(self, event: dict[str, Any]) -> Chunk:
        _error(event)
        chunk = Chunk()
        tokens = [int(t) for t in event.get("tokens") or ()]
        predicted = event.get("tokens_predicted")
        if tokens and isinstance(predicted, int) and predicted > self.seen + len(tokens) and event.get("content"):
            tokens = self.encode(event["content"])
            self.seen = predicted
        else:
            self.seen += len(tokens)
        chunk.tokens = tokens
        probs = event.get("completion_probabilities")
        if probs and len(probs) == len(tokens):
            chunk.logprobs = [(float(p.get("logprob", 0.0)), [(int(t["id"]), float(t["logprob"])) for t in p.get("top_logprobs") or ()]) for p in probs]
        if event.get("stop"):
            chunk.finish = _finish(event.get("stop_type"))
            timings = event.get("timings") or {}
            chunk.cached_tokens = timings.get("cache_n")
            chunk.prompt_tokens = event.get("tokens_evaluated")
            chunk.output_tokens = timings.get("predicted_n", event.get("tokens_predicted"))
        return chunk


def _token_id(text: str) -> int:
    """vLLM's ``return_tokens_as_token_ids`` spelling, ``token_id:123``."""
    return int(text.rsplit(":", 1)[1])


class VllmReader:
    """vLLM ``/v1/completions`` with ``return_token_ids``: ``choices[0].token_ids`` is each
    chunk's new ids and ``finish_reason`` its end; with ``include_usage`` a last chunk without
    choices carries ``usage`` (``prompt_tokens_details.cached_tokens`` when the server was
    started with ``--enable-prompt-tokens-details``)."""

    def __call__(self, event: dict[str, Any]) -> Chunk:
        _error(event)
        chunk = Chunk()
        for choice in event.get("choices") or ():
            chunk.tokens = [int(t) for t in choice.get("token_ids") or ()]
            lp = choice.get("logprobs")
            if isinstance(lp, dict) and lp.get("token_logprobs") and len(lp["token_logprobs"]) == len(chunk.tokens):
                tops = lp.get("top_logprobs") or [None] * len(chunk.tokens)
                chunk.logprobs = [(float(v), [(_token_id(k), float(x)) for k, x in (top or {}).items()]) for v, top in zip(lp["token_logprobs"], tops, strict=False)]
            chunk.finish = _finish(choice.get("finish_reason"))
        usage = event.get("usage")
        if isinstance(usage, dict):
            chunk.prompt_tokens = usage.get("prompt_tokens")
            chunk.output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            chunk.cached_tokens = details.get("cached_tokens")
        return chunk


class SglangReader:
    """SGLang ``/generate`` streaming: each chunk's ``output_ids`` holds every id so far (the
    default) or only the new ones (a server started with ``--stream-output``); which one is told
    by ``meta_info.completion_tokens``. ``meta_info.finish_reason`` is null or
    ``{"type": "stop"|"length"|"abort"}``; ``prompt_tokens`` and ``cached_tokens`` are there too."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, event: dict[str, Any]) -> Chunk:
        _error(event)
        meta = event.get("meta_info") or {}
        ids = [int(t) for t in event.get("output_ids") or ()]
        total = meta.get("completion_tokens")
        # The last (completion_tokens - seen) ids are new, whether the list is cumulative or not.
        count = min(len(ids), max(0, total - self.seen)) if isinstance(total, int) else len(ids)
        new = ids[len(ids) - count :] if count else []
        chunk = Chunk(tokens=new)
        logprobs = meta.get("output_token_logprobs")
        if logprobs:
            part = logprobs[-len(new) :] if new else []
            tops = (meta.get("output_top_logprobs") or [])[-len(new) :] if new else []
            if len(part) == len(new):
                chunk.logprobs = [(float(e[0]), [(int(t[1]), float(t[0])) for t in (tops[i] if i < len(tops) and tops[i] else ())]) for i, e in enumerate(part)]
        self.seen += len(new)
        reason = meta.get("finish_reason")
        if isinstance(reason, dict):
            chunk.finish = _finish(reason.get("type"))
            chunk.prompt_tokens = meta.get("prompt_tokens")
            chunk.cached_tokens = meta.get("cached_tokens")
            chunk.output_tokens = total
        return chunk
