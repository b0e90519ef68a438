"""Kiln's engine request as each engine's completion request (token ids in, token ids out).

One function per engine kind, each written from that engine's documented request fields:

- llama-server (llama.cpp, the revision bench/llama_cpp.py builds, tools/server/server-schema.cpp):
  ``POST /completion`` with ``prompt`` a token array, ``stream``, ``return_tokens`` (each streamed
  chunk then carries its token ids), ``n_predict``, ``n_probs`` and ``json_schema``. Its
  sampler chain is on by default (top_k 40, min_p 0.05, repeat penalty); they are turned off so
  that temperature and top_p mean what they mean on Kiln's own engine.
- vLLM (``CompletionRequest``, vllm/entrypoints/openai protocol, v0.10.2 and later):
  ``POST /v1/completions`` with ``prompt`` a token array, ``return_token_ids`` (each chunk's
  ``token_ids``), ``stream_options.include_usage``, ``stop_token_ids``, ``structured_outputs``.
- SGLang (``GenerateReqInput``, its native ``POST /generate``; its /v1/completions has no way to
  return token ids): ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``json_schema`` as
  a string, ``stop_token_ids``), ``stream``, ``return_logprob`` / ``top_logprobs_num``.

Nothing a client sends reaches these bodies except through ``SamplingParams`` and the
constraint, whose values were range-checked where the request was decoded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..engine.types import SamplingParams
from .constraint import EngineConstraint

Kind = Literal["llama-server", "vllm", "sglang"]
KINDS: tuple[Kind, ...] = ("llama-server", "vllm", "sglang")

# Every engine kind answers 200 on this path once its model is loaded (llama-server: 503 while
# loading; vLLM and SGLang: 200 from /health when the engine loop is up).
HEALTH_PATH = "/health"


@dataclass(frozen=True)
class UpstreamCall:
    path: str
    body: dict[str, Any]


def completion_call(kind: Kind, prompt: Sequence[int], params: SamplingParams, stop_tokens: Sequence[int], constraint: EngineConstraint | None, model: str | None = None) -> UpstreamCall:
    """The streamed completion request for ``prompt`` (token ids, the constraint's prefix
    already appended) on an engine of ``kind``."""
    if kind == "llama-server":
        return UpstreamCall("/completion", _llama_server(prompt, params, constraint))
    if kind == "vllm":
        return UpstreamCall("/v1/completions", _vllm(prompt, params, stop_tokens, constraint, model))
    if kind == "sglang":
        return UpstreamCall("/generate", _sglang(prompt, params, stop_tokens, constraint))
    raise ValueError(f"unknown upstream kind {kind!r}")


def _llama_server(prompt: Sequence[int], params: SamplingParams, constraint: EngineConstraint | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": list(prompt),
        "stream": True,
        "return_tokens": True,
        "cache_prompt": True,
        "n_predict": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": 0,
        "min_p": 0.0,
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.logprobs:
        body["n_probs"] = max(1, params.top_logprobs)
    if constraint is not None:
        body["json_schema"] = constraint.schema
    return body


def _vllm(prompt: Sequence[int], params: SamplingParams, stop_tokens: Sequence[int], constraint: EngineConstraint | None, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": list(prompt),
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop_token_ids": sorted(stop_tokens),
    }
    if model is not None:
        body["model"] = model
    if params.seed is not None:
        body["seed"] = params.seed
    if params.logprobs:
        body["logprobs"] = params.top_logprobs
        body["return_tokens_as_token_ids"] = True
    if constraint is not None:
        body["structured_outputs"] = {"json": constraint.schema}
    return body


def _sglang(prompt: Sequence[int], params: SamplingParams, stop_tokens: Sequence[int], constraint: EngineConstraint | None) -> dict[str, Any]:
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop_token_ids": sorted(stop_tokens),
    }
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    if constraint is not None:
        sampling["json_schema"] = json.dumps(constraint.schema)
    body: dict[str, Any] = {"input_ids": list(prompt), "sampling_params": sampling, "stream": True}
    if params.logprobs:
        body["return_logprob"] = True
        body["top_logprobs_num"] = params.top_logprobs
    return body
