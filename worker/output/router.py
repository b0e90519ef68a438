"""Routes generated text to reasoning, message text and tool calls for ``OutputAssembler``.

Two stages in series: the reasoning splitter takes the leading ``<think>`` block off, and the
tool-call parser (when tools are in play) takes call markup out of what remains. Both hold back
text that might be the start of their markup, so no markup leaks into ``output_text``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .events import Call, Piece
from .reasoning import ReasoningSplitter, prompt_opens_reasoning
from .tool_calls.base import ArgumentsDelta, CallStarted, TextDelta, ToolCallParser


class ResponseRouter:
    def __init__(self, reasoning: ReasoningSplitter | None, parser: ToolCallParser | None, *, forced: bool = False, forced_name: str | None = None) -> None:
        self._reasoning = reasoning
        self._parser = parser
        # A forced call's output is the grammar's call markup from its first token, so no part of
        # it is message text, even a start of the open tag that the parser cannot yet tell from
        # text when the output is cut there.
        self._forced = forced
        # The one function a forced call can name: a call cut off before its name was read is
        # still that call.
        self._forced_name = forced_name
        self._streamed_text: list[str] = []
        self._started_calls = 0

    def feed(self, text: str) -> list[Piece]:
        if not text:
            return []
        segments = self._reasoning.feed(text) if self._reasoning else [("content", text)]
        return self._route(segments)

    def finish(self) -> tuple[list[Piece], list[Call]]:
        pieces = self._route(self._reasoning.finish()) if self._reasoning else []
        if self._parser is None:
            return pieces, []
        final = self._parser.finish()
        calls = [Call(c.name, c.arguments) for c in final.calls]
        if final.cut is not None:  # the text ended inside a call: an incomplete call, not text
            calls.append(Call(final.cut.name or self._forced_name or "", final.cut.arguments, complete=False))
        if self._forced:
            if not calls:  # cut inside the open tag
                calls.append(Call(self._forced_name or "", "", complete=False))
            return pieces, calls
        streamed = "".join(self._streamed_text)
        # The final parse is authoritative; text it adds (e.g. a malformed call given back as
        # text) goes out now.
        truncated_call = self._started_calls > len(calls)
        if not truncated_call and final.text.startswith(streamed) and len(final.text) > len(streamed):
            pieces.append(Piece("content", final.text[len(streamed):]))
        return pieces, calls

    def _route(self, segments: Sequence[tuple[str, str]]) -> list[Piece]:
        pieces: list[Piece] = []
        for channel, text in segments:
            if channel == "reasoning":
                pieces.append(Piece("reasoning", text))
            elif self._parser is None:
                pieces.append(Piece("content", text))
            else:
                pieces.extend(self._parsed(self._parser.feed(text)))
        return pieces

    def _parsed(self, events: list[Any]) -> list[Piece]:
        pieces = []
        for event in events:
            if isinstance(event, TextDelta):
                if self._forced:
                    continue
                self._streamed_text.append(event.text)
                pieces.append(Piece("content", event.text))
            elif isinstance(event, CallStarted):
                self._started_calls += 1
                pieces.append(Piece("call_start", index=event.index, name=event.name))
            elif isinstance(event, ArgumentsDelta):
                pieces.append(Piece("call_args", event.delta, index=event.index))
        return pieces


def make_router(prompt_text: str, *, tools: list[dict[str, Any]], tool_choice: Any, parser_factory: Any, forced: bool = False, forced_name: str | None = None) -> ResponseRouter:
    """The router for one generation: reasoning always (cheap when absent), tools when declared.
    ``forced``: a grammar forces a call; ``forced_name``: the function it must be, when only one
    can be."""
    reasoning = ReasoningSplitter(start_in_reasoning=prompt_opens_reasoning(prompt_text))
    parser = parser_factory(tools) if tools and tool_choice != "none" else None
    return ResponseRouter(reasoning, parser, forced=forced and parser is not None, forced_name=forced_name)
