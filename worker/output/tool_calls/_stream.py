"""Shared bookkeeping of the streaming parsers: text, call indices, results."""

from __future__ import annotations

from .base import (
    ArgumentsDelta,
    CallStarted,
    FinalParse,
    ParsedCall,
    ParserEvent,
    ToolCallParser,
    Tools,
)
from ._json_stream import JsonCallReader, ReaderEvent
from ._text import TextOutput


class StreamingParser(ToolCallParser):
    """Base of the parsers that stream arguments: owns text and call records."""

    streams_arguments = True

    def __init__(self, tools: Tools | None = None) -> None:
        self._tools = tools or []
        self._out = TextOutput()
        self._calls: list[ParsedCall] = []
        self._started = 0
        self._finished: FinalParse | None = None

    def _text(self, text: str) -> list[ParserEvent]:
        return list(self._out.add(text)) if text else []

    def _start(self, name: str) -> CallStarted:
        self._started += 1
        return CallStarted(self._started - 1, name)

    def _args(self, fragment: str) -> ArgumentsDelta:
        return ArgumentsDelta(self._started - 1, fragment)

    def _record(self, name: str, arguments: str) -> None:
        self._calls.append(ParsedCall(name, arguments))

    def _reader_events(self, events: list[ReaderEvent]) -> list[ParserEvent]:
        return [self._start(v) if kind == "name" else self._args(v) for kind, v in events]

    def _settle_reader(self, reader: JsonCallReader) -> tuple[bool, list[ParserEvent]]:
        """Record an ended reader's call; a call read only whole is emitted now."""
        result = reader.result()
        if result is None:
            return False, []
        name, arguments = result
        events: list[ParserEvent] = []
        if not reader.streamed:
            events = [self._start(name), self._args(arguments)]
        self._record(name, arguments)
        return True, events

    def _final(self) -> FinalParse:
        return FinalParse(self._out.text, list(self._calls))
