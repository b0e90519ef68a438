"""Tokens -> Responses output items and stream events.

``OutputAssembler`` receives the decoded text of each generated token, routes it to reasoning,
message text or tool calls, and emits the stream events of each output item in the order a
Responses client expects: an item's ``response.output_item.added`` before any of its deltas, and
its final form in ``response.output_item.done``. Items end up ordered reasoning, message, calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kiln.protocol.events import (
    CONTENT_PART_ADDED,
    CONTENT_PART_DONE,
    FUNCTION_CALL_ARGUMENTS_DELTA,
    FUNCTION_CALL_ARGUMENTS_DONE,
    OUTPUT_ITEM_ADDED,
    OUTPUT_ITEM_DONE,
    OUTPUT_TEXT_DELTA,
    OUTPUT_TEXT_DONE,
    REASONING_TEXT_DELTA,
    REASONING_TEXT_DONE,
    Logprob,
    OutputItem,
    OutputTextPart,
    WorkerEvent,
)

from .ids import new_id

# Each event is a ``WorkerEvent`` (protocol/events.py): the shapes the gateway reads.
Emit = Callable[[WorkerEvent], None]


class TextRouter(Protocol):
    """Splits generated text into reasoning, plain content and tool-call pieces."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> tuple[list[Piece], list[Call]]: ...


@dataclass
class Piece:
    kind: str  # "reasoning" | "content" | "call_start" | "call_args"
    text: str = ""
    index: int = 0  # call index for call_* pieces
    name: str = ""


@dataclass
class Call:
    """A call's final form; ``complete`` is False for one the output ended inside (its
    ``arguments`` are then a prefix of JSON, and the item's status is ``incomplete``)."""

    name: str
    arguments: str
    complete: bool = True


class PlainRouter:
    """Everything is message text (no tools declared, no reasoning markup)."""

    def feed(self, text: str) -> list[Piece]:
        return [Piece("content", text)] if text else []

    def finish(self) -> tuple[list[Piece], list[Call]]:
        return [], []


def logprob_entry(token_text: str, logprob: float, top: list[tuple[str, float]] | None) -> Logprob:
    return {
        "token": token_text,
        "logprob": float(logprob),
        "bytes": list(token_text.encode("utf-8")),
        "top_logprobs": [
            {"token": t, "logprob": float(lp), "bytes": list(t.encode("utf-8"))} for t, lp in (top or [])
        ],
    }


@dataclass
class _Item:
    index: int
    item: OutputItem
    text: list[str] = field(default_factory=list)


class OutputAssembler:
    def __init__(
        self,
        emit: Emit,
        *,
        router: TextRouter | None = None,
        want_logprobs: bool = False,
        namespaces: dict[str, str] | None = None,
        max_tool_calls: int | None = None,
    ) -> None:
        self._emit = emit
        # ``max_tool_calls``: calls past this many are parsed but never emitted.
        self._max_calls = max_tool_calls
        self._router = router or PlainRouter()
        self._want_logprobs = want_logprobs
        self._namespaces = namespaces or {}
        self._next_index = 0
        self._reasoning: _Item | None = None
        self._message: _Item | None = None
        self._calls: dict[int, _Item] = {}
        self._pending_logprobs: list[Logprob] = []
        self._logprobs: list[Logprob] = []
        self.output_tokens = 0
        self.reasoning_tokens = 0

    # -- input -----------------------------------------------------------------------------------
    def add_token(self, text: str, logprob: Logprob | None = None) -> None:
        """One generated token and its decoded text (may be "" while a character is incomplete)."""
        self.output_tokens += 1
        if logprob is not None and self._want_logprobs:
            self._pending_logprobs.append(logprob)
        pieces = self._router.feed(text)
        if self._reasoning is not None and self._message is None and not self._calls:
            # Tokens spent before any answer text count as reasoning.
            if all(p.kind == "reasoning" for p in pieces) or not pieces:
                self.reasoning_tokens += 1
        for piece in pieces:
            self._apply(piece)

    def finish(self, reason: str) -> tuple[str, dict[str, Any] | None]:
        """Close every item; returns (status, incomplete_details) for the response."""
        pieces, calls = self._router.finish()
        for piece in pieces:
            self._apply(piece)
        incomplete = reason == "length"
        if self._message is None and not calls and not self._calls:
            self._open_message()
        self._close_reasoning()
        self._close_message(incomplete)
        self._close_calls(calls)
        if incomplete:
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    # -- routing ---------------------------------------------------------------------------------
    def _apply(self, piece: Piece) -> None:
        if piece.kind == "reasoning":
            self._reasoning_delta(piece.text)
        elif piece.kind == "content":
            self._content_delta(piece.text)
        elif piece.kind == "call_start":
            self._open_call(piece.index, piece.name)
        elif piece.kind == "call_args":
            self._call_delta(piece.index, piece.text)

    def _allocate(self) -> int:
        index = self._next_index
        self._next_index += 1
        return index

    # -- reasoning -------------------------------------------------------------------------------
    def _reasoning_delta(self, text: str) -> None:
        if not text:
            return
        if self._reasoning is None:
            item: OutputItem = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            self._reasoning = _Item(self._allocate(), item)
            self._emit({"type": OUTPUT_ITEM_ADDED, "output_index": self._reasoning.index, "item": dict(item)})
        self._reasoning.text.append(text)
        self._emit(
            {
                "type": REASONING_TEXT_DELTA,
                "item_id": self._reasoning.item["id"],
                "output_index": self._reasoning.index,
                "content_index": 0,
                "delta": text,
            }
        )

    def _close_reasoning(self) -> None:
        r = self._reasoning
        if r is None or r.item["status"] != "in_progress":
            return
        text = "".join(r.text)
        self._emit({"type": REASONING_TEXT_DONE, "item_id": r.item["id"], "output_index": r.index, "content_index": 0, "text": text})
        r.item = {**r.item, "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}
        self._emit({"type": OUTPUT_ITEM_DONE, "output_index": r.index, "item": r.item})

    # -- message ---------------------------------------------------------------------------------
    def _open_message(self) -> None:
        item: OutputItem = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        self._message = _Item(self._allocate(), item)
        self._emit({"type": OUTPUT_ITEM_ADDED, "output_index": self._message.index, "item": dict(item, content=[])})
        part: OutputTextPart = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._emit(
            {
                "type": CONTENT_PART_ADDED,
                "item_id": item["id"],
                "output_index": self._message.index,
                "content_index": 0,
                "part": part,
            }
        )

    def _content_delta(self, text: str) -> None:
        if not text:
            return
        if self._message is None:
            if self._reasoning is not None:
                self._close_reasoning()
            self._open_message()
        assert self._message is not None
        self._message.text.append(text)
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        self._logprobs.extend(logprobs)
        self._emit(
            {
                "type": OUTPUT_TEXT_DELTA,
                "item_id": self._message.item["id"],
                "output_index": self._message.index,
                "content_index": 0,
                "delta": text,
                "logprobs": logprobs,
            }
        )

    def _close_message(self, incomplete: bool) -> None:
        m = self._message
        if m is None:
            return
        text = "".join(m.text)
        self._logprobs.extend(self._pending_logprobs)
        self._pending_logprobs = []
        item_id = m.item["id"]
        self._emit({"type": OUTPUT_TEXT_DONE, "item_id": item_id, "output_index": m.index, "content_index": 0, "text": text, "logprobs": self._logprobs})
        part: OutputTextPart = {"type": "output_text", "text": text, "annotations": [], "logprobs": self._logprobs}
        self._emit({"type": CONTENT_PART_DONE, "item_id": item_id, "output_index": m.index, "content_index": 0, "part": part})
        m.item = {**m.item, "content": [part], "status": "incomplete" if incomplete else "completed"}
        self._emit({"type": OUTPUT_ITEM_DONE, "output_index": m.index, "item": m.item})

    # -- function calls --------------------------------------------------------------------------
    def _call_item(self, name: str) -> OutputItem:
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": new_id("call"), "name": name, "arguments": ""}
        if name in self._namespaces:
            item["namespace"] = self._namespaces[name]
        return item

    def _open_call(self, index: int, name: str) -> None:
        if index in self._calls or (self._max_calls is not None and index >= self._max_calls):
            return
        if self._reasoning is not None:
            self._close_reasoning()
        call = _Item(self._allocate(), self._call_item(name))
        self._calls[index] = call
        self._emit({"type": OUTPUT_ITEM_ADDED, "output_index": call.index, "item": dict(call.item)})

    def _call_delta(self, index: int, delta: str) -> None:
        call = self._calls.get(index)
        if call is None or not delta:
            return
        call.text.append(delta)
        self._emit({"type": FUNCTION_CALL_ARGUMENTS_DELTA, "item_id": call.item["id"], "output_index": call.index, "delta": delta})

    def _close_calls(self, calls: list[Call]) -> None:
        if self._max_calls is not None:
            calls = calls[: self._max_calls]
        for index, final in enumerate(calls):
            call = self._calls.get(index)
            if call is None:
                self._open_call(index, final.name)
                call = self._calls[index]
            sent = "".join(call.text)
            # When the authoritative parse disagrees with what streamed, the done event carries it.
            if final.arguments.startswith(sent) and len(final.arguments) > len(sent):
                self._call_delta(index, final.arguments[len(sent):])
            arguments = final.arguments
            self._emit({"type": FUNCTION_CALL_ARGUMENTS_DONE, "item_id": call.item["id"], "output_index": call.index, "name": final.name, "arguments": arguments})
            # A call whose arguments are whole is completed even when the response was cut after
            # it; only a call the output ended inside is incomplete.
            call.item = {**call.item, "name": final.name, "arguments": arguments, "status": "completed" if final.complete else "incomplete"}
            self._emit({"type": OUTPUT_ITEM_DONE, "output_index": call.index, "item": call.item})
        for index in sorted(self._calls):
            if index >= len(calls):  # started streaming but the final parse dropped it
                call = self._calls[index]
                call.item = {**call.item, "arguments": "".join(call.text), "status": "incomplete"}
                self._emit({"type": OUTPUT_ITEM_DONE, "output_index": call.index, "item": call.item})

