"""Mistral tool calls: ``[TOOL_CALLS]name[ARGS]{..}`` and ``[TOOL_CALLS][{"name": .., "arguments": ..}]``.

Newer Mistral templates (v11+) write a header per call, which may repeat
with or without another ``[TOOL_CALLS]`` (and may carry ``[CALL_ID]id``);
older ones (v3/v7) write one JSON list. Neither has an end token, so after a
call the parser waits to see whether another call or plain text follows.
"""

from __future__ import annotations

import json
from typing import Literal

import regex

from ._json_stream import JsonCallReader, JsonScanner
from ._stream import StreamingParser
from .base import ParserEvent, Tools

MARKER = "[TOOL_CALLS]"

# "name[ARGS]" (optionally "name[CALL_ID]id[ARGS]"), up to the arguments.
_HEADER = regex.compile(r"([\w.\-]+)(?:\[CALL_ID\][\w\-]*)?\s*\[ARGS\]\s*")

_State = Literal["text", "section", "header", "args", "list", "element", "after"]


class MistralParser(StreamingParser):
    """Streams Mistral calls in both forms; the arguments go out as generated."""

    def __init__(self, tools: Tools | None = None) -> None:
        super().__init__(tools)
        self._state: _State = "text"
        self._raw = ""  # markup consumed for the call being read (text if it fails)
        self._name = ""
        self._scanner: JsonScanner | None = None
        self._args_text = ""
        self._reader: JsonCallReader | None = None

    def _flush(self) -> None:
        if self._state == "element" and self._reader is not None:
            ok, _ = self._settle_reader(self._reader)
            if not ok:
                self._text(self._raw + self._reader.raw)
            self._text(self._buf)
        elif self._state in ("args", "section", "header", "list"):
            self._text(self._raw + self._args_text + self._buf)
        else:
            self._text(self._buf)

    def _fail(self, extra: str = "") -> list[ParserEvent]:
        """The call being read is not one: its markup goes back into the text."""
        events = self._text(self._raw + extra)
        self._state, self._raw, self._args_text = "text", "", ""
        return events

    def _run(self, final: bool) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        while True:
            state = self._state
            if state == "text":
                text_events, found = self._text_until(MARKER, final)
                events += text_events
                if not found:
                    return events
                self._state, self._raw = "section", MARKER
            elif state in ("section", "after"):
                stripped = self._buf.lstrip()
                if not stripped:
                    return events
                if state == "after":
                    if stripped.startswith(MARKER):
                        self._buf = stripped[len(MARKER) :]
                        self._state, self._raw = "section", MARKER
                        continue
                    if MARKER.startswith(stripped) and not final:
                        return events
                self._raw += self._buf[: len(self._buf) - len(stripped)]
                self._buf = stripped
                if state == "section" and stripped.startswith("["):
                    self._state, self._raw, self._buf = "list", self._raw + "[", stripped[1:]
                    continue
                m = _HEADER.match(stripped, partial=True)
                if m is None or (m.partial and final):
                    if state == "after":
                        self._state, self._raw = "text", ""
                        continue
                    events += self._fail()
                    continue
                if m.partial:
                    return events
                self._raw += stripped[: m.end()]
                self._buf = stripped[m.end() :]
                self._name = m.group(1)
                events.append(self._start(self._name))
                self._state = "header"
            elif state == "header":
                if not self._buf:
                    return events
                if not self._buf.startswith("{"):
                    events += self._fail()
                    continue
                self._state, self._scanner, self._args_text = "args", JsonScanner(), ""
            elif state == "args":
                assert self._scanner is not None
                self._scanner.feed(self._buf)
                if self._scanner.end is None:
                    if self._buf:
                        events.append(self._args(self._buf))
                    self._args_text += self._buf
                    self._buf = ""
                    return events
                cut = self._scanner.end - len(self._args_text)
                piece, self._buf = self._buf[:cut], self._buf[cut:]
                if self._scanner.broken:
                    events += self._fail(self._args_text + piece)
                    continue
                if piece:
                    events.append(self._args(piece))
                self._args_text += piece
                if not self._valid_args(self._args_text):
                    events += self._fail(self._args_text)
                    continue
                self._record(self._name, self._args_text)
                self._state, self._raw, self._args_text = "after", "", ""
            elif state == "list":
                stripped = self._buf.lstrip()
                if not stripped:
                    return events
                self._raw += self._buf[: len(self._buf) - len(stripped)]
                self._buf = stripped
                if stripped.startswith("{"):
                    self._state, self._reader = "element", JsonCallReader()
                elif stripped.startswith(","):
                    self._raw, self._buf = self._raw + ",", stripped[1:]
                elif stripped.startswith("]"):
                    self._state, self._raw, self._buf = "after", "", stripped[1:]
                else:
                    events += self._fail()
            else:  # element
                assert self._reader is not None
                chunk, self._buf = self._buf, ""
                reader_events, leftover = self._reader.feed(chunk)
                events += self._reader_events(reader_events)
                if not self._reader.ended:
                    return events
                ok, settled = self._settle_reader(self._reader)
                events += settled
                self._buf = leftover
                if ok:
                    self._state, self._raw = "list", ""
                else:
                    events += self._fail(self._reader.raw)
                self._reader = None

    def _valid_args(self, text: str) -> bool:
        try:
            return isinstance(json.loads(text), dict)
        except json.JSONDecodeError:
            return False
