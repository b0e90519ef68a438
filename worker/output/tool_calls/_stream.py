"""Shared bookkeeping of the parsers: input buffer, text, call indices, results."""

from __future__ import annotations

from abc import abstractmethod

from ._json_stream import JsonCallReader, ReaderEvent
from ._text import TextOutput, held_suffix_len
from .base import (
    ArgumentsDelta,
    CallStarted,
    CutCall,
    FinalParse,
    ParsedCall,
    ParserEvent,
    ToolCallParser,
    Tools,
)


class BufferedParser(ToolCallParser):
    """Base of every parser: buffers what is fed and owns the text and calls.

    A subclass implements ``_run``, which consumes ``self._buf`` as far as it
    can be settled, and ``_flush``, which settles what is still open once the
    text has ended; ``feed`` and ``finish`` drive them.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._out = TextOutput()
        self._calls: list[ParsedCall] = []
        self._cut: CutCall | None = None
        self._finished: FinalParse | None = None

    def feed(self, text: str) -> list[ParserEvent]:
        if self._finished is not None:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        return self._run(final=False)

    def finish(self) -> FinalParse:
        if self._finished is None:
            self._run(final=True)
            self._flush()
            self._buf = ""
            self._finished = FinalParse(self._out.text, list(self._calls), self._cut)
        return self._finished

    @abstractmethod
    def _run(self, final: bool) -> list[ParserEvent]:
        """Consume ``self._buf`` as far as it is settled (``final``: no more text comes)."""

    @abstractmethod
    def _flush(self) -> None:
        """After the final ``_run``: end what is still open, as calls or as text.

        Its events are not streamed (``finish`` is authoritative); the buffer
        is emptied afterwards.
        """

    def _text(self, text: str) -> list[ParserEvent]:
        return list(self._out.add(text)) if text else []


class StreamingParser(BufferedParser):
    """Base of the parsers that stream arguments: call indices and JSON call readers."""

    streams_arguments = True

    def __init__(self, tools: Tools | None = None) -> None:
        super().__init__()
        self._tools = tools or []
        self._started = 0

    def _text_until(self, marker: str, final: bool) -> tuple[list[ParserEvent], bool]:
        """Stream the text before ``marker`` and drop the marker: (events, True).

        Without ``marker`` in the buffer, stream all of it but an end that may
        begin the marker (all of it if ``final``): (events, False).
        """
        pos = self._buf.find(marker)
        if pos == -1:
            cut = len(self._buf) - (0 if final else held_suffix_len(self._buf, (marker,)))
            events = self._text(self._buf[:cut])
            self._buf = self._buf[cut:]
            return events, False
        events = self._text(self._buf[:pos])
        self._buf = self._buf[pos + len(marker) :]
        return events, True

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
