"""Llama 3.x JSON tool calls: ``{"name": .., "parameters": {..}}``, maybe after ``<|python_tag|>``.

Llama 3 has no wrapping tags: a reply that *starts* with a call object is a
call (as vLLM reads it); ``<|python_tag|>`` marks one anywhere. Several calls
may be separated by ``;`` or whitespace. A reply that starts with ``{`` but is
not a call head (``{"name": .., "parameters"|"arguments": {``) is plain text,
and is released as soon as that is certain.
"""

from __future__ import annotations

from typing import Literal

from ._json_stream import JsonCallReader
from ._stream import StreamingParser
from .base import ParserEvent, Tools

PYTHON_TAG = "<|python_tag|>"

_State = Literal["start", "text", "expect", "call", "after"]


class Llama3Parser(StreamingParser):
    """Streams Llama 3 JSON calls; the arguments go out as generated."""

    def __init__(self, tools: Tools | None = None) -> None:
        super().__init__(tools)
        self._state: _State = "start"
        self._tagged = False  # the current call was announced by <|python_tag|>
        self._call_raw = ""
        self._reader: JsonCallReader | None = None

    def _flush(self) -> None:
        if self._state == "call" and self._reader is not None:
            ok, _ = self._settle_reader(self._reader)
            if not ok:
                self._text(self._call_raw)
        elif self._state == "expect":
            self._text(self._call_raw + self._buf)
        else:
            self._text(self._buf)

    def _begin_call(self, tagged: bool, raw_prefix: str) -> None:
        self._state, self._tagged, self._call_raw = "expect", tagged, raw_prefix

    def _run(self, final: bool) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        while True:
            if self._state in ("start", "after"):
                stripped = self._buf.lstrip()
                if not stripped or (PYTHON_TAG.startswith(stripped) and not final):
                    return events
                if stripped.startswith(PYTHON_TAG):
                    self._buf = stripped[len(PYTHON_TAG) :]
                    self._begin_call(True, PYTHON_TAG)
                elif stripped.startswith("{"):
                    self._buf = stripped
                    self._begin_call(False, "")
                elif self._state == "after" and stripped.startswith(";"):
                    self._buf = stripped[1:]
                    self._begin_call(False, "")
                else:
                    self._state = "text"
                continue
            if self._state == "text":
                text_events, found = self._text_until(PYTHON_TAG, final)
                events += text_events
                if not found:
                    return events
                self._begin_call(True, PYTHON_TAG)
                continue
            if self._state == "expect":
                stripped = self._buf.lstrip()
                if not stripped:
                    return events
                self._call_raw += self._buf[: len(self._buf) - len(stripped)]
                self._buf = stripped
                if stripped.startswith("{"):
                    self._state, self._reader = "call", JsonCallReader()
                else:  # not a JSON call (say ipython code): plain text
                    events += self._text(self._call_raw)
                    self._state = "text"
                continue
            # state == "call"
            assert self._reader is not None
            chunk, self._buf = self._buf, ""
            reader_events, leftover = self._reader.feed(chunk)
            self._call_raw += chunk[: len(chunk) - len(leftover)]
            if self._reader.head_failed and not self._tagged:
                # A reply that merely starts with "{": text after all.
                self._state, self._buf, self._reader = "text", self._call_raw + leftover, None
                continue
            events += self._reader_events(reader_events)
            if not self._reader.ended:
                return events
            ok, settled = self._settle_reader(self._reader)
            events += settled
            if not ok:
                events += self._text(self._call_raw)
            self._state, self._buf, self._reader = "after", leftover, None
