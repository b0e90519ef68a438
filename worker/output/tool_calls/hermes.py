"""Hermes / Qwen JSON tool calls: ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``.

The format of Qwen2.5/Qwen3, Hermes and the fallback for templates without
tool support (the tool prompt teaches this syntax). Several calls may follow
each other, and a block may hold more than one object. A block whose content
is not a valid call is returned as text. A call the text ends inside (cut off by
max_output_tokens, as a forced call under a small cap is) is ``FinalParse.cut``, never text.
"""

from __future__ import annotations

from ._json_stream import JsonCallReader
from ._stream import StreamingParser
from .base import CutCall, ParserEvent, Tools

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(StreamingParser):
    """Streams Hermes-style JSON calls; the arguments go out as generated."""

    def __init__(self, tools: Tools | None = None) -> None:
        super().__init__(tools)
        self._in_block = False
        self._block_raw = ""
        self._block_ok = 0
        self._reader: JsonCallReader | None = None

    def _flush(self) -> None:
        if not self._in_block:
            return
        reader = self._reader
        if reader is not None:
            ok, _ = self._settle_reader(reader)
            self._block_ok += ok
            if not ok and not reader.ended and not reader.head_failed:
                self._cut_off(reader.name, reader.partial_arguments)
                return
        elif not self._buf.strip() and not self._block_ok:
            self._cut_off(None, "")  # the block opened, its object had not begun
            return
        self._block_raw += self._buf
        self._close_block()

    def _cut_off(self, name: str | None, arguments: str) -> None:
        self._in_block, self._reader = False, None
        self._cut = CutCall(name, arguments)

    def _run(self, final: bool) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        while True:
            if not self._in_block:
                text_events, found = self._text_until(OPEN, final)
                events += text_events
                if not found:
                    return events
                self._in_block, self._block_raw, self._block_ok = True, OPEN, 0
                continue
            if self._reader is not None:
                chunk, self._buf = self._buf, ""
                reader_events, leftover = self._reader.feed(chunk)
                self._block_raw += chunk[: len(chunk) - len(leftover)]
                events += self._reader_events(reader_events)
                if not self._reader.ended:
                    return events
                ok, settled = self._settle_reader(self._reader)
                events += settled
                self._block_ok += ok
                self._reader, self._buf = None, leftover
                continue
            # Inside a block, between call objects.
            stripped = self._buf.lstrip()
            if stripped.startswith("{"):
                self._block_raw += self._buf[: len(self._buf) - len(stripped)]
                self._buf = stripped
                self._reader = JsonCallReader()
                continue
            pos = self._buf.find(CLOSE)
            if pos == -1:
                return events  # wait for the close tag (or more of the object)
            self._block_raw += self._buf[: pos + len(CLOSE)]
            self._buf = self._buf[pos + len(CLOSE) :]
            events += self._close_block()

    def _close_block(self) -> list[ParserEvent]:
        """End the block; one that produced no call is the model's text."""
        self._in_block = False
        if self._block_ok:
            return []
        return self._text(self._block_raw)
