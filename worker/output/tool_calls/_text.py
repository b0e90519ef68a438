"""Plain-text bookkeeping shared by the parsers: stripping and held-back markup.

Whitespace around tool calls is formatting, so the text is stripped at both
ends. Streaming that exactly means never emitting leading whitespace and
holding trailing whitespace until more text follows; the final text is then
exactly what was emitted plus whatever ``finish`` adds.
"""

from __future__ import annotations

from collections.abc import Iterable

from .base import TextDelta


class TextOutput:
    """Accumulates the assistant text and decides what may be streamed now."""

    def __init__(self) -> None:
        self._started = False
        self._pending_ws = ""
        self._parts: list[str] = []

    def add(self, text: str) -> list[TextDelta]:
        """Add text; return the delta that is safe to stream (maybe none)."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return []
            self._started = True
        combined = self._pending_ws + text
        body = combined.rstrip()
        self._pending_ws = combined[len(body) :]
        if not body:
            return []
        self._parts.append(body)
        return [TextDelta(body)]

    @property
    def text(self) -> str:
        """Everything emitted so far (the final text once finished)."""
        return "".join(self._parts)


def held_suffix_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that could begin one of ``markers``.

    That much must be held back: the next chunk may complete the marker.
    """
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def find_first(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str]:
    """The earliest occurrence of any marker: (position, marker), or (-1, "")."""
    found, which = -1, ""
    for marker in markers:
        pos = text.find(marker, start)
        if pos != -1 and (found == -1 or pos < found or (pos == found and len(marker) > len(which))):
            found, which = pos, marker
    return found, which
