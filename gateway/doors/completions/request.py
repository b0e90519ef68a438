"""Legacy Completions (``POST /v1/completions``): a plain ``prompt`` continued as raw text.

The request becomes a Responses create body like a chat request does, with ``raw_prompt`` beside
it (the door's option, never a body field) so the worker skips the chat template (a legacy client sends the exact text to continue). The events
are read by the Chat door's translator (text, stop sequences, logprobs) and framed as
``text_completion`` objects instead of chat chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kiln.protocol.events import OUTPUT_TEXT_DELTA, Logprob

from ...http.errors import invalid
from ...lifecycle.generation import RunEvent
from ..chat.framer import ChatTranslator, chat_usage
from ..chat.request import LOGPROBS_INCLUDE, ChatRequest, _max_tokens, _stop, _streaming
from ..validation import parse_bool

DEFAULT_MAX_TOKENS = 16  # the legacy API's default
MAX_LOGPROBS = 5
PASSED = ("model", "temperature", "top_p", "seed", "metadata")


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, list):
        raise invalid("'prompt' as several prompts or as token ids is not supported: send one string.", param="prompt")
    if not isinstance(value, str) or not value:
        raise invalid("Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    return value


def translate_completion(raw: dict[str, Any]) -> ChatRequest:
    """The Responses create body for a legacy completion request and the door's options."""
    for key, ok in (("n", 1), ("best_of", 1)):
        if raw.get(key) is not None and raw[key] != ok:
            raise invalid(f"Invalid '{key}': this server generates one completion per request; '{key}' must be 1.", param=key)
    if parse_bool(raw.get("echo"), "echo"):
        raise invalid("'echo' is not supported.", param="echo")
    if raw.get("suffix"):
        raise invalid("'suffix' is not supported.", param="suffix")
    prompt = _prompt(raw.get("prompt"))
    body: dict[str, Any] = {k: raw[k] for k in PASSED if raw.get(k) is not None}
    body.update(input=[{"type": "message", "role": "user", "content": prompt}], store=False)
    body["max_output_tokens"] = _max_tokens(raw) or DEFAULT_MAX_TOKENS
    logprobs = raw.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS:
            raise invalid(f"Invalid 'logprobs': expected an integer from 0 to {MAX_LOGPROBS}.", param="logprobs")
        body.update(include=[LOGPROBS_INCLUDE], top_logprobs=logprobs)
    stream, include_usage = _streaming(raw, body)
    return ChatRequest(body=body, stream=stream, include_usage=include_usage, logprobs=logprobs is not None, stop=_stop(raw.get("stop")), raw_prompt=prompt)


def _legacy_logprobs(entries: list[Logprob], offset: int) -> dict[str, Any]:
    """Chat-style token logprobs in the legacy shape (parallel arrays, top as a mapping)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in entries],
        "text_offset": offsets,
    }


class CompletionTranslator(ChatTranslator):
    """The legacy view of one response: ``text_completion`` chunks and object."""

    def __init__(self, response_id: str, model: str, **kwargs: Any) -> None:
        super().__init__(response_id, model, **kwargs)
        self.id = "cmpl-" + response_id.removeprefix("resp_")
        self._offset = 0

    def _choice(self, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(self, delta: dict[str, Any], logprobs: list[Logprob] | None = None, finish_reason: str | None = None) -> dict[str, Any]:
        text = delta.get("content") or ""
        legacy = _legacy_logprobs(logprobs, self._offset) if logprobs is not None else None
        self._offset += len(text)
        out = {**self._head("text_completion"), "choices": [self._choice(text, legacy, finish_reason)]}
        if self.include_usage:
            out["usage"] = None
        return out

    def feed(self, event: RunEvent) -> list[dict[str, Any]]:
        # Text only: reasoning and tool calls have no place in a legacy completion.
        return super().feed(event) if event.get("type") == OUTPUT_TEXT_DELTA else []

    def opening(self) -> dict[str, Any] | None:
        return None  # the legacy stream has no role chunk

    def usage_chunk(self, usage: Mapping[str, Any] | None) -> dict[str, Any]:
        return {**self._head("text_completion"), "choices": [], "usage": chat_usage(usage)}

    def completion(self, status: str, usage: Mapping[str, Any] | None, cost: Decimal | None = None) -> dict[str, Any]:
        logprobs = _legacy_logprobs(self.logprobs, 0) if self.want_logprobs else None
        choice = self._choice("".join(self.content), logprobs, self.finish_reason(status))
        return {**self._head("text_completion"), "choices": [choice], "usage": chat_usage(usage, cost)}
