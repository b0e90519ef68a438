"""Stop sequences, applied in the gateway door.

The worker has no stop-sequence support (its request contract has none), so a door that offers
``stop`` cuts the streamed text itself: ``StopCutter`` holds back just enough text to recognise a
stop sequence split across deltas, releases the rest, and says when one was found so the door can
cancel the generation (the worker is told to stop; only the tokens generated so far are billed).
"""

from __future__ import annotations


class StopCutter:
    """Incremental search for the first of ``stops`` in a stream of text pieces; one cutter for
    every door that offers stop sequences (Chat and legacy Completions ``stop``, Anthropic
    ``stop_sequences``)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]  # an empty sequence would match at once
        self._pending = ""
        # The stop sequence found (Anthropic reports which one), None until then.
        self.matched: str | None = None

    @property
    def hit(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> str:
        """The text safe to deliver now: everything except a tail that could still be the start
        of a stop sequence, held until the next piece decides it; "" once one was seen."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, self.matched = min(hits)
            self._pending = ""
            return buf[:at]
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1) if buf.endswith(s[:n])), default=0)
        self._pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """What was held back, at the end of the text (no stop sequence completed)."""
        out, self._pending = self._pending, ""
        return out
