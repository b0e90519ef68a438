"""A request's sampling settings as the engine's ``SamplingParams``.

The ranges are checked where the request is built (``kiln.protocol.request.Sampling``, at the
gateway and again when the worker decodes the frame), so this only adds what needs the prompt:
``max_output_tokens`` is capped by the context left once the prompt is known, and an unset one
takes the worker's default.
"""

from __future__ import annotations

from kiln.protocol.request import Sampling

from .engine.types import SamplingParams


def engine_params(sampling: Sampling, room: int, default_max_output_tokens: int) -> SamplingParams:
    """SamplingParams for a prompt that leaves ``room`` tokens of the context window."""
    cap = sampling.max_output_tokens if sampling.max_output_tokens is not None else default_max_output_tokens
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=min(cap, room),
        top_logprobs=sampling.top_logprobs,
        logprobs=sampling.logprobs,
        seed=sampling.seed,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
    )
