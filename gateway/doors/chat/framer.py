"""Responses stream events -> Chat Completions chunks and the final ``chat.completion``.

``ChatTranslator`` reads the events a ``ResponseRun`` yields and keeps what a chat client sees:
the assistant text (cut at a stop sequence), ``reasoning_content`` from reasoning deltas, tool
calls numbered by ``index`` in the order they opened, and the logprobs of the text. The streaming
route sends its deltas as chunks; the non-streaming route builds the whole message from the same
state, so both agree by construction. It is the door's ``Framer`` (``../framing.py``): ``data:``
chunks, the closing chunk with ``finish_reason``, the usage chunk when asked for (the usage billed)
and ``[DONE]``; a failure mid-stream is sent as an error payload (the OpenAI SDKs raise it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kiln.protocol.events import Logprob, is_arguments_delta, is_item_added, is_item_done, is_reasoning_delta, is_text_delta

from ...lifecycle.generation import GenerationFailed, RunEvent
from ...lifecycle.run import ResponseRun
from ..stop import StopCutter

DONE = b"data: [DONE]\n\n"


def completion_id(response_id: str) -> str:
    return "chatcmpl-" + response_id.removeprefix("resp_")


def chat_usage(usage: Mapping[str, Any] | None, cost: Decimal | None = None) -> dict[str, Any]:
    """A Responses usage as Chat's ``usage`` (with the hosted ``cost`` when one was debited)."""
    usage = usage or {}
    prompt = int(usage.get("input_tokens") or 0)
    completion = int(usage.get("output_tokens") or 0)
    cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    reasoning = int((usage.get("output_tokens_details") or {}).get("reasoning_tokens") or 0)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }
    if cost is not None:
        out["cost"] = float(cost)
    return out


class ChatTranslator:
    """The chat view of one response, built from its Responses events."""

    def __init__(self, response_id: str, model: str, *, logprobs: bool = False, stop: list[str] | None = None, include_usage: bool = False) -> None:
        self.id = completion_id(response_id)
        self.model = model
        self.created = int(time.time())
        self.want_logprobs = logprobs
        self.include_usage = include_usage
        self.cutter = StopCutter(stop or [])
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[Logprob] = []
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "arguments"} in index order
        self._call_index: dict[str, int] = {}  # Responses item id -> chat tool-call index
        self._pending_logprobs: list[Logprob] = []  # of text held back by the cutter

    @property
    def stopped(self) -> bool:
        """True once a stop sequence was generated: the door cancels the rest."""
        return self.cutter.hit

    # -- events -> deltas -------------------------------------------------------------------------
    def feed(self, event: RunEvent) -> list[dict[str, Any]]:
        """The chat chunks one Responses event gives (often none)."""
        if is_text_delta(event):
            return self._text(event.get("delta") or "", event.get("logprobs") or [])
        if is_reasoning_delta(event) and event.get("delta") and not self.stopped:
            self.reasoning.append(event["delta"])
            return [self.chunk({"reasoning_content": event["delta"]})]
        if is_item_added(event) and (event.get("item") or {}).get("type") == "function_call":
            return [self.chunk({"tool_calls": [self._open_call(event["item"])]})]
        if is_arguments_delta(event):
            index = self._call_index.get(event.get("item_id", ""))
            if index is None or not event.get("delta"):
                return []
            self.calls[index]["arguments"] += event["delta"]
            return [self.chunk({"tool_calls": [{"index": index, "function": {"arguments": event["delta"]}}]})]
        if is_item_done(event) and (event.get("item") or {}).get("type") == "function_call":
            return self._close_call(event["item"])
        return []

    def _text(self, delta: str, logprobs: list[Logprob]) -> list[dict[str, Any]]:
        if self.stopped:
            return []
        released = self.cutter.feed(delta)
        if self.want_logprobs:
            self._pending_logprobs.extend(logprobs)
        if self.stopped:
            # Tokens held back with the stop sequence are not part of the answer (approximate
            # when one token straddles the cut: it is dropped with the stop sequence).
            self._pending_logprobs = []
        return self._release(released)

    def _release(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.content.append(text)
        entries, self._pending_logprobs = self._pending_logprobs, []
        self.logprobs.extend(entries)
        return [self.chunk({"content": text}, entries if self.want_logprobs else None)]

    def _open_call(self, item: Mapping[str, Any]) -> dict[str, Any]:
        index = len(self.calls)
        self._call_index[item.get("id", "")] = index
        name = item.get("name", "")
        self.calls.append({"id": item.get("call_id") or item.get("id", ""), "name": name, "arguments": ""})
        return {"index": index, "id": self.calls[index]["id"], "type": "function", "function": {"name": name, "arguments": ""}}

    def _close_call(self, item: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The final arguments win; a tail the deltas did not carry is sent as one more delta."""
        index = self._call_index.get(item.get("id", ""))
        if index is None:
            return []
        call = self.calls[index]
        final = item.get("arguments") or ""
        tail = final[len(call["arguments"]):] if final.startswith(call["arguments"]) else ""
        call["arguments"] = final
        call["name"] = item.get("name") or call["name"]
        return [self.chunk({"tool_calls": [{"index": index, "function": {"arguments": tail}}]})] if tail else []

    def flush(self) -> list[dict[str, Any]]:
        """Text held back while looking for a stop sequence, at the end of generation."""
        return self._release(self.cutter.flush())

    # -- framing -----------------------------------------------------------------------------------
    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, delta: dict[str, Any], logprobs: list[Logprob] | None = None, finish_reason: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None, "finish_reason": finish_reason}
        out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # every chunk but the last carries a null usage, as OpenAI's do
        return out

    def opening(self) -> dict[str, Any] | None:
        """The first chunk (the role), or None for a door without one. It carries no ``content``:
        it leaves before the answer is known to be text, and a ``content: ""`` ahead of a tool
        call is an empty text part to clients such as the Vercel AI SDK."""
        return self.chunk({"role": "assistant"})

    def finish_reason(self, status: str) -> str:
        if status == "incomplete" and not self.stopped:
            return "length"
        return "tool_calls" if self.calls else "stop"

    def closing(self, status: str) -> dict[str, Any]:
        return self.chunk({}, finish_reason=self.finish_reason(status))

    def usage_chunk(self, usage: Mapping[str, Any] | None) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": chat_usage(usage)}

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) if (self.content or not self.calls) else None, "refusal": None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
        return message

    def completion(self, status: str, usage: Mapping[str, Any] | None, cost: Decimal | None = None) -> dict[str, Any]:
        logprobs = {"content": self.logprobs, "refusal": None} if self.want_logprobs else None
        choice = {"index": 0, "message": self.message(), "logprobs": logprobs, "finish_reason": self.finish_reason(status)}
        return {**self._head("chat.completion"), "choices": [choice], "usage": chat_usage(usage, cost)}

    # -- the Framer --------------------------------------------------------------------------------
    def frame(self, payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def opening_frames(self, run: ResponseRun) -> list[bytes]:
        first = self.opening()
        return [] if first is None else [self.frame(first)]

    def closing_frames(self, run: ResponseRun) -> list[bytes]:
        chunks = [*self.flush(), self.closing(run.response.status)]
        if self.include_usage:
            chunks.append(self.usage_chunk(run.billable_usage(client_gone=False).to_map()))
        return [*map(self.frame, chunks), DONE]

    def error_frames(self, run: ResponseRun, failure: GenerationFailed) -> list[bytes]:
        return [self.frame(failure.api_error().body()), DONE]

    def answer(self, run: ResponseRun, cost: Decimal | None) -> dict[str, Any]:
        self.flush()
        return self.completion(run.response.status, run.billable_usage(client_gone=False).to_map(), cost)
