"""``kiln-worker --engine upstream``: what build_server needs, built from the settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import WorkerSettings
from .constraint import Constraints
from .scheduler import UpstreamScheduler
from .tokenizer_source import load_tokenizer


@dataclass
class UpstreamEngine:
    tokenizer: Any
    scheduler: UpstreamScheduler
    constraints: Constraints
    model_id: str
    aliases: list[str]
    context_window: int


def build_upstream(settings: WorkerSettings) -> UpstreamEngine:
    """The tokenizer of --model (no weights) and the scheduler streaming from --upstream. The
    capacity is --max-batch: set it to the engine's own concurrency (llama-server --parallel,
    vLLM --max-num-seqs), so the gateways queue what the engine would only queue itself."""
    if not settings.upstream:
        raise ValueError("--engine upstream needs --upstream, the engine's URL")
    if not settings.upstream.startswith(("http://", "https://")):
        raise ValueError(f"--upstream must be an http:// or https:// URL, got {settings.upstream!r}")
    source = load_tokenizer(settings.model)
    tokenizer = source.tokenizer
    scheduler = UpstreamScheduler(settings.upstream, settings.upstream_kind, tokenizer.encode, capacity=settings.max_batch, queue_depth=settings.queue_depth, model=settings.upstream_model,
        api_key=settings.upstream_api_key)
    model_id = settings.model_id or source.model_id
    aliases = sorted(set(source.aliases) | set(settings.model_alias) | {source.model_id, model_id})
    window = min(source.context_window, settings.context_length) if settings.context_length else source.context_window
    return UpstreamEngine(tokenizer, scheduler, Constraints(enabled=not settings.upstream_unconstrained), model_id, aliases, window)
