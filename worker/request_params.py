"""Sampling settings of a Generate body, checked before anything is rendered or queued.

The gateway validates the same fields; this is defence in depth. A value the sampler cannot
honour (a seed of "x", -1 or 1.5, a NaN temperature) must be refused here with a 400 naming
the field: found later, inside a batched prefill or decode step, it would fail every request
sharing the pass, and Python's own exception text would reach the client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .engine.types import MAX_SEED, MAX_TOP_LOGPROBS, SamplingParams

MAX_TEMPERATURE = 2.0


class InvalidParam(ValueError):
    """A body field outside what the API allows; ``param`` names it for the error object."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class Sampling:
    """The checked settings; max_output_tokens is capped by the context left once the prompt
    is known (see ``params``)."""

    temperature: float
    top_p: float
    top_logprobs: int
    logprobs: bool
    seed: int | None
    max_output_tokens: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def params(self, room: int) -> SamplingParams:
        """SamplingParams for a prompt that leaves ``room`` tokens of the context window."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=min(self.max_output_tokens, room),
            top_logprobs=self.top_logprobs,
            logprobs=self.logprobs,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return (isinstance(value, float) and math.isfinite(value)) or _is_int(value)


def sampling_from_body(body: dict[str, Any], default_max_output_tokens: int) -> Sampling:
    """The body's sampling settings; raises InvalidParam for the first bad one."""
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    elif not _is_finite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidParam("temperature", f"Invalid 'temperature': expected a number from 0 to {MAX_TEMPERATURE:g}.")
    top_p = body.get("top_p")
    if top_p is None:
        top_p = 1.0
    elif not _is_finite(top_p) or not 0 < top_p <= 1:
        raise InvalidParam("top_p", "Invalid 'top_p': expected a number greater than 0 and at most 1.")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is None:
        top_logprobs = 0
    elif not _is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidParam("top_logprobs", f"Invalid 'top_logprobs': expected an integer from 0 to {MAX_TOP_LOGPROBS}.")
    max_output = body.get("max_output_tokens")
    if max_output is None:
        max_output = default_max_output_tokens
    elif not _is_int(max_output) or max_output < 1:
        raise InvalidParam("max_output_tokens", "Invalid 'max_output_tokens': expected an integer of at least 1.")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise InvalidParam("seed", f"Invalid 'seed': expected an integer from 0 to {MAX_SEED}.")
    penalties = []
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is None:
            value = 0.0
        elif not _is_finite(value) or not -2 <= value <= 2:
            raise InvalidParam(name, f"Invalid '{name}': expected a number from -2 to 2.")
        penalties.append(float(value))
    include = body.get("include") or []
    logprobs = bool(top_logprobs) or (isinstance(include, list) and "message.output_text.logprobs" in include)
    return Sampling(float(temperature), float(top_p), top_logprobs, logprobs, seed, max_output, *penalties)
