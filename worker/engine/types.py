"""The engine's vocabulary: what a caller hands the scheduler and what it gets back.

Kept free of scheduling logic so the worker server (and tests) can build requests and
read steps without importing the model-owning machinery.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from kiln.protocol.request import MAX_SEED, MAX_TOP_LOGPROBS

# mlx-lm's logits processor signature: (all tokens so far incl. the prompt, logits (1, vocab))
# -> new logits. Structured output plugs in here.
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A real number (NaN fails every range check that follows)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request decoding settings; every request in a batch may differ."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 256
    top_logprobs: int = 0  # 0..20: report this many alternatives per step
    logprobs: bool = False  # report the chosen token's logprob
    seed: int | None = None
    # OpenAI's penalties on tokens already generated: logits -= frequency * count + presence * (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def validate(self) -> None:
        """Reject settings the sampler cannot honour, before the request is queued (a bad value
        found later, inside a batch, would fail the step of every request sharing it)."""
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError("temperature must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in 0..{MAX_SEED}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in -2..2")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Step:
    """One generated token (or the terminal event) of one request.

    finish_reason: None while running; "stop" (token is a stop token: not to be shown),
    "length", "cancelled", "error".
    """

    token: int | None  # None only on a terminal step that carries no token (cancelled, error, an upstream engine's "length")
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None
    error: str | None = None
    # With "error": the engine was unreachable (an upstream engine down), not this request's
    # fault: answered 503 so that the gateway retries elsewhere or the client later.
    unavailable: bool = False


@dataclass
class EngineRequest:
    """A tokenized prompt plus how to decode it and where to send the tokens."""

    prompt: list[int]
    params: SamplingParams
    stop_tokens: frozenset[int]
    # Called on the scheduler thread for every step; must not block; the last call has
    # finish_reason set.
    on_step: Callable[[Step], None]
    # Called on the scheduler thread after each chunk of a long prompt's prefill (no token yet);
    # must not block. The worker reports it to the gateway, whose between-events deadline counts
    # silence, so a long prompt being processed is never taken for a hung worker.
    on_progress: Callable[[], None] | None = None
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    cache_key: str | None = None  # prompt_cache_key hint
    cache_scope: str | None = None  # the prefix cache entries this request may see (cache.py)
    # Set by the engine before the first on_step: prompt tokens served from the prefix cache.
    cached_tokens: int = 0


class QueueFull(Exception):
    """Raised by Scheduler.submit when queue_depth requests are already waiting."""
