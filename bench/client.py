"""Streaming HTTP clients that time one generation: TTFT, decode rate, latency, usage.

Two wire formats, one result type:
  ResponsesAPI  Kiln's POST /v1/responses (SSE events `response.output_text.delta`, final
                `response.completed` / `response.incomplete` carrying usage);
  ChatAPI       OpenAI chat completions (mlx_lm.server, llama.cpp): SSE `data:` chunks with
                `choices[0].delta.content`, usage in the last chunk (`stream_options.include_usage`).

Times are `time.perf_counter()` seconds, taken when a line of the SSE body is read.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

Message = dict[str, str]  # {"role": "system"|"user"|"assistant", "content": str}


@dataclass
class StreamResult:
    start: float
    end: float = 0.0
    first_delta: float | None = None
    delta_times: list[float] = field(default_factory=list)
    text: str = ""
    output_tokens: int | None = None  # from the server's usage; None if it sent none
    input_tokens: int | None = None
    cached_tokens: int | None = None
    status: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_delta is not None

    @property
    def tokens(self) -> int:
        """Output tokens: the server's count, else the number of text deltas."""
        return self.output_tokens if self.output_tokens is not None else len(self.delta_times)

    @property
    def ttft(self) -> float | None:
        return None if self.first_delta is None else self.first_delta - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first / time from the first to the last text delta."""
        if self.first_delta is None or len(self.delta_times) < 2 or self.tokens < 2:
            return None
        span = self.delta_times[-1] - self.first_delta
        return (self.tokens - 1) / span if span > 0 else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.delta_times, self.delta_times[1:], strict=False)]


class _API:
    path = ""

    def __init__(self, base_url: str, model: str, exact_length: dict[str, Any] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.exact_length = dict(exact_length or {})  # the server's own fields for "no early EOS"

    def body(self, messages: list[Message], max_tokens: int, temperature: float, stream: bool = True) -> dict[str, Any]:
        raise NotImplementedError

    def on_event(self, event: str | None, data: str, result: StreamResult, now: float) -> bool:
        """Handle one SSE event; return True when the stream is finished."""
        raise NotImplementedError

    async def stream(self, client: httpx.AsyncClient, messages: list[Message], max_tokens: int, temperature: float = 0.0, timeout: float = 900.0, exact: bool = False) -> StreamResult:
        """Stream one generation. `exact`: ask for exactly `max_tokens`, where the server can."""
        result = StreamResult(start=time.perf_counter())
        body = self.body(messages, max_tokens, temperature)
        if exact:
            body.update(self.exact_length)
        try:
            async with client.stream("POST", self.base_url + self.path, json=body, timeout=timeout) as response:
                if response.status_code != 200:
                    raw = await response.aread()
                    result.error = f"HTTP {response.status_code}: {raw[:300].decode(errors='replace')}"
                    return result
                event: str | None = None
                data_lines: list[str] = []
                async for line in response.aiter_lines():
                    now = time.perf_counter()
                    if line == "":
                        if data_lines:
                            if self.on_event(event, "\n".join(data_lines), result, now):
                                break
                        event, data_lines = None, []
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data_lines.append(line[5:].lstrip())
                    # ":" comments (keep-alives) and other fields are ignored
                if data_lines:
                    self.on_event(event, "\n".join(data_lines), result, time.perf_counter())
        except (httpx.HTTPError, OSError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            result.end = time.perf_counter()
        if result.error is None and result.first_delta is None:
            result.error = f"no text delta (status {result.status or 'unknown'})"
        return result


class ResponsesAPI(_API):
    """Kiln: POST /v1/responses, stream=true."""

    path = "/v1/responses"

    def body(self, messages, max_tokens, temperature, stream=True):
        return {
            "model": self.model,
            "input": [{"role": m["role"], "content": m["content"]} for m in messages],
            "max_output_tokens": max_tokens,
            "temperature": temperature,
            "stream": stream,
        }

    def on_event(self, event, data, result, now):
        try:
            payload = json.loads(data)
        except ValueError:
            return False
        kind = payload.get("type") or event or ""
        if kind == "response.output_text.delta":
            delta = payload.get("delta") or ""
            if delta:
                if result.first_delta is None:
                    result.first_delta = now
                result.delta_times.append(now)
                result.text += delta
            return False
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            response = payload.get("response") or {}
            result.status = response.get("status") or kind
            usage = response.get("usage") or {}
            result.output_tokens = usage.get("output_tokens")
            result.input_tokens = usage.get("input_tokens")
            result.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            if kind == "response.failed":
                result.error = f"response.failed: {response.get('error')}"
            return True
        if kind == "error":
            result.error = f"error event: {payload.get('message') or payload}"
            return True
        return False


class ChatAPI(_API):
    """mlx_lm.server, llama.cpp: POST /v1/chat/completions, stream=true with usage."""

    path = "/v1/chat/completions"

    def body(self, messages, max_tokens, temperature, stream=True):
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": stream,
            "stream_options": {"include_usage": True},
        }

    def on_event(self, event, data, result, now):
        if data.strip() == "[DONE]":
            return True
        try:
            payload = json.loads(data)
        except ValueError:
            return False
        if "error" in payload and not payload.get("choices"):
            result.error = f"error: {payload['error']}"
            return True
        for choice in payload.get("choices") or []:
            content = (choice.get("delta") or {}).get("content") or ""
            if content:
                if result.first_delta is None:
                    result.first_delta = now
                result.delta_times.append(now)
                result.text += content
            if choice.get("finish_reason"):
                result.status = choice["finish_reason"]
        usage = payload.get("usage")
        if usage:
            result.output_tokens = usage.get("completion_tokens")
            result.input_tokens = usage.get("prompt_tokens")
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return False


def make_api(kind: str, base_url: str, model: str, exact_length: dict[str, Any] | None = None) -> _API:
    return {"responses": ResponsesAPI, "chat": ChatAPI}[kind](base_url, model, exact_length)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
