"""Stop sequences, applied in the gateway door.

The worker has no stop-sequence support (its request contract has none), so a door that offers
``stop`` cuts the streamed text itself: ``StopCutter`` holds back just enough text to recognise a
stop sequence split across deltas, releases the rest, and says when one was found so the door can
cancel the generation (the worker is told to stop; only the tokens generated so far are billed).
"""

from __future__ import annotations


class StopCutter:
    """Incremental search for the first of ``stops`` in a stream of text pieces."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """The part of the text so far that can be released; "" once a stop sequence was seen."""
        if self.hit:
            return ""
        if not self.stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = self._hold
        if keep <= 0:
            out, self._pending = self._pending, ""
            return out
        out, self._pending = self._pending[:-keep], self._pending[-keep:]
        return out

    def flush(self) -> str:
        """What was held back, at the end of the text (no stop sequence completed)."""
        out, self._pending = ("" if self.hit else self._pending), ""
        return out
