"""Qwen3-Coder XML tool calls, produced as JSON arguments.

    <tool_call>
    <function=name>
    <parameter=p>
    value
    </parameter>
    </function>
    </tool_call>

The arguments are built as JSON while generated: ``{`` when the function
opens, ``"p": `` when a parameter opens, a string value escaped character by
character (one leading and one trailing newline are formatting), a typed
value (integer, object, ...) whole when its parameter closes, ``}`` at
``</function>``. The text so built is the final arguments, so the stream is
always exactly the final. As in Qwen's reference parser, a missing
``</parameter>`` is forgiven and the ``<tool_call>`` wrapper is optional.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import regex

from ._schema_values import convert_value, streams_as_string
from ._stream import StreamingParser
from ._text import find_first, held_suffix_len
from .base import ParserEvent, Tools, parameter_schemas

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNC = "<function="
FUNC_END = "</function>"
PARAM_END = "</parameter>"

_FUNC_HEAD = regex.compile(r"<function=\s*([^\s<>]+)\s*>")
_PARAM_HEAD = regex.compile(r"<parameter=\s*([^\s<>]+)\s*>")
_VALUE_ENDS = (PARAM_END, "<parameter=", FUNC_END)

_State = Literal["text", "func", "param", "value", "skip"]


def _escaped(text: str) -> str:
    """JSON string escaping without the quotes (character-local, so chunkable)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderParser(StreamingParser):
    """Streams Qwen3-Coder XML calls as JSON arguments, typed by the schemas."""

    def __init__(self, tools: Tools | None = None) -> None:
        super().__init__(tools)
        self._schemas = parameter_schemas(tools)
        self._state: _State = "text"
        self._block_raw = ""
        self._block_ok = 0
        self._name = ""
        self._props: dict[str, Any] | None = None
        self._args_text = ""
        self._params = 0
        self._param_schema: dict[str, Any] | None = None
        self._streaming_value = False
        self._value = ""  # raw value text so far (terminator not included)
        self._value_sent = 0  # characters of the trimmed value already sent

    def _flush(self) -> None:
        if self._state == "text":
            self._text(self._buf)
        else:
            self._block_raw += self._value + self._buf
            self._close_block()

    # -- helpers ---------------------------------------------------------

    def _consume(self, n: int) -> None:
        self._block_raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _emit(self, fragment: str) -> list[ParserEvent]:
        self._args_text += fragment
        return [self._args(fragment)] if fragment else []

    def _close_block(self) -> list[ParserEvent]:
        """End the block; one that produced no call is the model's text."""
        raw, ok = self._block_raw, self._block_ok
        self._state, self._block_raw, self._block_ok = "text", "", 0
        return [] if ok else self._text(raw)

    def _open_block(self, raw: str) -> None:
        self._state, self._block_raw, self._block_ok = "func", raw, 0

    # -- the state machine -------------------------------------------------

    def _run(self, final: bool) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        while True:
            step = getattr(self, f"_step_{self._state}")(final)
            if step is None:
                return events
            events += step

    def _step_text(self, final: bool) -> list[ParserEvent] | None:
        pos, marker = find_first(self._buf, (OPEN, FUNC))
        if pos == -1:
            cut = len(self._buf) - (0 if final else held_suffix_len(self._buf, (OPEN, FUNC)))
            events = self._text(self._buf[:cut])
            self._buf = self._buf[cut:]
            return events or None
        events = self._text(self._buf[:pos])
        self._buf = self._buf[pos:]
        if marker == OPEN:
            self._buf = self._buf[len(OPEN) :]
            self._open_block(OPEN)
        else:
            self._open_block("")
        return events

    def _step_func(self, final: bool) -> list[ParserEvent] | None:
        stripped = self._buf.lstrip()
        if not stripped:
            return None
        self._consume(len(self._buf) - len(stripped))
        if stripped.startswith(CLOSE):
            self._consume(len(CLOSE))
            return self._close_block()
        m = _FUNC_HEAD.match(stripped, partial=True)
        if m is not None and not m.partial:
            self._consume(m.end())
            self._name, self._args_text, self._params = m.group(1), "", 0
            self._props = self._schemas.get(self._name)
            events: list[ParserEvent] = [self._start(self._name)]
            events += self._emit("{")
            self._state = "param"
            return events
        if not final and (m is not None or CLOSE.startswith(stripped)):
            return None
        if final:  # an incomplete tag at the very end: the model's text
            rest, self._buf = self._buf, ""
            return self._close_block() + self._text(rest)
        # Anything else ends the block; what follows is text again.
        return self._close_block()

    def _step_param(self, final: bool) -> list[ParserEvent] | None:
        stripped = self._buf.lstrip()
        if not stripped:
            return None
        self._consume(len(self._buf) - len(stripped))
        if stripped.startswith(FUNC_END):
            self._consume(len(FUNC_END))
            events = self._emit("}")
            self._record(self._name, self._args_text)
            self._block_ok += 1
            self._state = "func"
            return events
        m = _PARAM_HEAD.match(stripped, partial=True)
        if m is not None and not m.partial:
            self._consume(m.end())
            pname = m.group(1)
            self._param_schema = (self._props or {}).get(pname)
            self._streaming_value = streams_as_string(self._param_schema)
            key = (", " if self._params else "") + json.dumps(pname, ensure_ascii=False) + ": "
            self._params += 1
            self._value, self._value_sent = "", 0
            self._state = "value"
            return self._emit(key + ('"' if self._streaming_value else ""))
        if not final and (m is not None or FUNC_END.startswith(stripped)):
            return None
        self._state = "skip"  # not this format after all: the call is broken
        return []

    def _step_value(self, final: bool) -> list[ParserEvent] | None:
        searched = max(0, len(self._value) - len(PARAM_END))
        self._value += self._buf
        self._buf = ""
        pos, marker = find_first(self._value, _VALUE_ENDS, searched)
        if pos == -1:
            if final or not self._streaming_value:
                return None
            hold = held_suffix_len(self._value, _VALUE_ENDS)
            safe = self._value[: len(self._value) - hold]
            if safe.endswith("\n"):
                safe = safe[:-1]  # maybe the newline before </parameter>
            if not safe:
                return None
            lead = 1 if safe.startswith("\n") else 0
            body = safe[lead:]
            fragment = body[self._value_sent :]
            self._value_sent = len(body)
            return self._emit(_escaped(fragment)) or None
        raw_value, rest = self._value[:pos], self._value[pos:]
        if marker == PARAM_END:
            raw_value_consumed, rest = raw_value + PARAM_END, rest[len(PARAM_END) :]
        else:
            raw_value_consumed = raw_value
        self._block_raw += raw_value_consumed
        self._buf, self._value = rest + self._buf, ""
        value = raw_value[1:] if raw_value.startswith("\n") else raw_value
        value = value[:-1] if value.endswith("\n") else value
        self._state = "param"
        if self._streaming_value:
            return self._emit(_escaped(value[self._value_sent :]) + '"')
        converted = convert_value(value, self._param_schema)
        return self._emit(json.dumps(converted, ensure_ascii=False))

    def _step_skip(self, final: bool) -> list[ParserEvent] | None:
        pos = self._buf.find(CLOSE)
        if pos == -1:
            return None
        self._consume(pos + len(CLOSE))
        return self._close_block()
