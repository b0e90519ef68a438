"""Per-request token samplers, and choosing one token per row of a batch.

Every request in a batch may have its own temperature, top_p and seed, so each row gets
its own sampler; rows that are all greedy collapse to a single argmax (the common case
for tools and evals). Seeded requests carry their own PRNG key so their output does not
depend on which other requests shared the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from .types import SamplingParams

# (logprobs (1, vocab)) -> token ids (1,)
Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    """Argmax; a module-level function so a batch can tell that every row is greedy."""
    return mx.argmax(logprobs, axis=-1)


class SeededSampler:
    """Temperature / top-p sampling from a private key, split once per token.

    The global mlx PRNG is shared by every request on the scheduler thread, so a seed
    can only be honoured with a key of its own.
    """

    def __init__(self, temperature: float, top_p: float, seed: int) -> None:
        self._inv_temp = 1.0 / temperature
        self._top_p = top_p
        self._key = mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        if self._top_p < 1.0:
            logprobs = apply_top_p(logprobs, self._top_p)
        return mx.random.categorical(logprobs * self._inv_temp, key=sub)


class RandomSampler:
    """Temperature / top-p sampling from the scheduler thread's global PRNG."""

    def __init__(self, temperature: float, top_p: float) -> None:
        self._inv_temp = 1.0 / temperature
        self._top_p = top_p

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self._top_p < 1.0:
            logprobs = apply_top_p(logprobs, self._top_p)
        return mx.random.categorical(logprobs * self._inv_temp)


class PenalizedSampler:
    """OpenAI's presence and frequency penalties over the tokens this request has generated:
    each token's logit is lowered by ``frequency * count + presence * (count > 0)`` before the
    inner sampler picks. The counts live in a vocab-sized array updated lazily per token, so a
    penalized request keeps to its own row and never blocks the batch. Shifting logprobs instead
    of logits picks the same tokens (a row's log-softmax differs from its logits by a constant)."""

    def __init__(self, inner: Sampler, presence: float, frequency: float) -> None:
        self._inner = inner
        self._presence = presence
        self._frequency = frequency
        self._counts: mx.array | None = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        vocab = logprobs.shape[-1]
        if self._counts is None:
            self._counts = mx.zeros((vocab,), dtype=mx.float32)
        counts = self._counts
        adjusted = logprobs - (counts * self._frequency + (counts > 0).astype(mx.float32) * self._presence).astype(logprobs.dtype)
        token = self._inner(adjusted)
        self._counts = counts + (mx.arange(vocab) == token.reshape(-1)[0]).astype(mx.float32)
        return token


def make_sampler(params: SamplingParams) -> Sampler:
    """The sampler a request's settings call for."""
    if params.greedy:
        inner: Sampler = greedy
    elif params.seed is not None:
        inner = SeededSampler(params.temperature, params.top_p, params.seed)
    else:
        inner = RandomSampler(params.temperature, params.top_p)
    if params.presence_penalty or params.frequency_penalty:
        return PenalizedSampler(inner, params.presence_penalty, params.frequency_penalty)
    return inner


def sample_rows(logprobs: mx.array, samplers: list[Sampler]) -> mx.array:
    """One token per row of logprobs (B, vocab), each row by its own sampler; lazy."""
    if all(s is greedy for s in samplers):
        return greedy(logprobs)
    return mx.concatenate([s(logprobs[i : i + 1]) for i, s in enumerate(samplers)])


def top_k_logprobs(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k most likely tokens of each row (unordered) and their logprobs; lazy."""
    idx = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    return idx, mx.take_along_axis(logprobs, idx, axis=-1)
