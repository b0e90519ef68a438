"""Incremental reading of JSON tool calls (Hermes, Mistral lists, Llama 3).

A model writes ``{"name": "f", "arguments": {...}}`` one token at a time. To
stream the arguments we only need to know where the arguments object starts
(once the head ``{"name": "f", "arguments":`` is complete) and where it ends
(bracket matching outside strings); the raw text in between is streamed as
is, so the streamed fragments concatenate to exactly the final arguments.
Calls whose keys come in another order are still parsed, but only once the
whole object is complete.
"""

from __future__ import annotations

import json
from typing import Literal

import regex

# The head of a streamable call object, up to where its arguments object
# starts. Matched with partial=True so an incomplete head waits, and a head
# that can no longer match (other key order, string arguments) falls back.
_HEAD = regex.compile(
    r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?'
    r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
    r'"(?:arguments|parameters)"\s*:\s*(?=\{)',
    regex.DOTALL,
)

# Characters that can appear in JSON outside strings; anything else (say the
# "<" of a closing tag) means the object is broken and ends there.
_JSON_OUTSIDE = set('{}[],:"-+.0123456789 \t\r\n') | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class JsonScanner:
    """Finds where one JSON object or array ends, without parsing it.

    Fed the text that starts at the opening bracket, piece by piece. ``end``
    becomes the offset just past the matching close bracket; ``broken`` is set
    (with ``end`` at the offending character) when a character that cannot be
    JSON appears outside a string.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._seen = 0
        self.end: int | None = None
        self.broken = False

    def feed(self, text: str) -> None:
        """Scan more text; stops at the end of the value (the rest is ignored)."""
        if self.end is not None:
            return
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch not in _JSON_OUTSIDE:
                self.end, self.broken = self._seen + i, True
                return
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self.end = self._seen + i + 1
                    return
        self._seen += len(text)


ReaderEvent = tuple[Literal["name", "args"], str]


class JsonCallReader:
    """Reads one ``{"name": ..., "arguments": {...}}`` call object incrementally.

    ``feed`` returns the events it settles (``("name", name)`` once, then
    ``("args", fragment)``s) and the text past the end of the object, if it
    ended. ``result`` gives the parsed call once ended (or at finish).
    """

    def __init__(self) -> None:
        self._buf = ""
        self._outer = JsonScanner()
        self._head: Literal["pending", "matched", "failed"] = "pending"
        self._args: JsonScanner | None = None
        self._args_start = 0
        self._args_fed = 0
        self._args_end: int | None = None
        self._args_sent = 0
        self.name: str | None = None
        self.ended = False

    @property
    def streamed(self) -> bool:
        """Whether the name (and arguments) went out as they were generated."""
        return self._head == "matched"

    @property
    def head_failed(self) -> bool:
        """Whether the object can no longer be a streamable call head."""
        return self._head == "failed"

    @property
    def partial_arguments(self) -> str:
        """The arguments text streamed so far (a prefix of a JSON object; "" before it began)."""
        return self._buf[self._args_start : self._args_sent] if self._head == "matched" else ""

    @property
    def raw(self) -> str:
        """The text of the object read so far."""
        return self._buf

    def feed(self, text: str) -> tuple[list[ReaderEvent], str]:
        """Consume text; return settled events and the text past the object."""
        if self.ended:
            return [], text
        self._buf += text
        self._outer.feed(text)
        leftover = ""
        if self._outer.end is not None:
            leftover = self._buf[self._outer.end :]
            self._buf = self._buf[: self._outer.end]
            self.ended = True
        return self._advance(), leftover

    def _advance(self) -> list[ReaderEvent]:
        events: list[ReaderEvent] = []
        if self._head == "pending":
            m = _HEAD.match(self._buf, partial=True)
            if m is None or (m.partial and self.ended):
                self._head = "failed"
            elif not m.partial:
                try:
                    self.name = json.loads(f'"{m.group(1)}"')
                except json.JSONDecodeError:
                    self._head = "failed"
                else:
                    self._head = "matched"
                    self._args_start = self._args_fed = self._args_sent = m.end()
                    self._args = JsonScanner()
                    events.append(("name", self.name))
        if self._head == "matched" and self._args is not None:
            if self._args_end is None:
                self._args.feed(self._buf[self._args_fed :])
                self._args_fed = len(self._buf)
                if self._args.end is not None and not self._args.broken:
                    self._args_end = self._args_start + self._args.end
                elif self._args.broken:
                    self._args = None
            if self._args is not None:
                stop = self._args_end if self._args_end is not None else len(self._buf)
                if stop > self._args_sent:
                    events.append(("args", self._buf[self._args_sent : stop]))
                    self._args_sent = stop
        return events

    def result(self) -> tuple[str, str] | None:
        """(name, arguments JSON text) if this is a valid call, else None.

        A streamed call needs only its arguments object complete and valid
        (a broken tail of the envelope, say a missing final brace, is
        forgiven); other calls need the whole object to be valid JSON.
        """
        if self._head == "matched" and self._args_end is not None and self.name is not None:
            args_text = self._buf[self._args_start : self._args_end]
            try:
                args = json.loads(args_text)
            except json.JSONDecodeError:
                return None
            return (self.name, args_text) if isinstance(args, dict) else None
        if self._head == "matched" or not self.ended or self._outer.broken:
            return None
        try:
            obj = json.loads(self._buf)
        except json.JSONDecodeError:
            return None
        return call_from_object(obj)


def call_from_object(obj: object) -> tuple[str, str] | None:
    """(name, arguments JSON text) from a decoded call object, if it is one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)
