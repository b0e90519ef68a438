"""Formats whose calls come out only at the end, parsed by mlx-lm's tool_parsers.

Pythonic (``[f(a=1)]``), Gemma, Kimi, GLM, MiniMax, ... are hard to stream
safely, so their blocks (between the module's ``tool_call_start`` and
``tool_call_end``) are held back and handed to mlx-lm's parser when they
close; the calls are reported by ``finish``. The text around the blocks still
streams. A block that does not parse is the model's text.

Pythonic calls may also come without markers (Llama 3.2 style: the whole
reply is ``[f(a=1), g()]``); a reply that starts like that is held to the end.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import regex

from ._stream import BufferedParser
from ._text import held_suffix_len
from .base import ParsedCall, ParserEvent, Tools, nested_tools

# Replies that are a call list without markers, per format.
_BARE_STARTS = {"pythonic": regex.compile(r"\[\s*[A-Za-z_][\w.]*\(")}


class EndOnlyParser(BufferedParser):
    """Holds back call blocks of an mlx-lm format and parses them when closed."""

    streams_arguments = False

    def __init__(self, format_name: str, tools: Tools | None = None) -> None:
        super().__init__()
        module = importlib.import_module(f"mlx_lm.tool_parsers.{format_name}")
        self.format_name = format_name
        self._parse: Callable[[str, Any], Any] = module.parse_tool_call
        self._start: str = module.tool_call_start
        self._end: str = module.tool_call_end
        self._bare = _BARE_STARTS.get(format_name)
        self._tools = nested_tools(tools)
        self._at_start = True
        self._in_block = False
        self._bare_block = False
        self._searched = 0  # where to resume looking for the end marker

    def _flush(self) -> None:
        if self._in_block:
            body = self._buf if self._bare_block else self._buf[len(self._start) :]
            self._close(self._buf, body)
        else:
            self._out.add(self._buf)

    def _run(self, final: bool) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        while True:
            if self._in_block:
                if self._bare_block or not self._end:
                    return events
                pos = self._buf.find(self._end, max(len(self._start), self._searched))
                if pos == -1:
                    self._searched = max(0, len(self._buf) - len(self._end) + 1)
                    return events
                self._searched = 0
                raw = self._buf[: pos + len(self._end)]
                events += self._close(raw, self._buf[len(self._start) : pos])
                self._buf = self._buf[len(raw) :]
                continue
            if self._at_start and self._bare is not None:
                stripped = self._buf.lstrip()
                if not stripped:
                    return events
                m = self._bare.match(stripped, partial=True)
                if m is not None and m.partial and not final:
                    return events
                self._at_start = False
                if m is not None and not m.partial:
                    self._buf, self._in_block, self._bare_block = stripped, True, True
                    continue
            pos = self._buf.find(self._start)
            if pos == -1:
                cut = len(self._buf) - (0 if final else held_suffix_len(self._buf, (self._start,)))
                events += self._out.add(self._buf[:cut])
                self._at_start = self._at_start and not self._buf[:cut].strip()
                self._buf = self._buf[cut:]
                return events
            events += self._out.add(self._buf[:pos])
            self._buf, self._in_block, self._at_start = self._buf[pos:], True, False

    def _close(self, raw: str, body: str) -> list[ParserEvent]:
        """End a block: record its calls, or give it back as text."""
        self._in_block = self._bare_block = False
        calls = self._parse_block(body)
        if calls is None:
            return list(self._out.add(raw))
        self._calls += calls
        return []

    def _parse_block(self, body: str) -> list[ParsedCall] | None:
        try:
            parsed = self._parse(body, self._tools or None)
        except Exception:  # model output is untrusted; any failure means "not a call"
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        calls: list[ParsedCall] = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            args = item.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append(ParsedCall(item["name"], json.dumps(args, ensure_ascii=False)))
        return calls or None
