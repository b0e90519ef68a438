"""Server-sent event framing with monotonic sequence numbers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


class EventSequencer:
    """Numbers the events of one stream and frames them as ``event:`` + ``data:`` lines.

    The SSE ``event:`` name always equals the payload's ``type``, and ``sequence_number`` rises
    by one per event, which is what OpenAI's SDKs and Codex rely on.
    """

    def __init__(self, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._next = 0
        # Sees every numbered event (the streamed-retrieval buffer of a stored response).
        self._on_event = on_event

    def stamp(self, event: dict[str, Any]) -> dict[str, Any]:
        event = {**event, "sequence_number": self._next}
        self._next += 1
        if self._on_event is not None:
            self._on_event(event)
        return event

    def frame(self, event: dict[str, Any]) -> bytes:
        return frame_numbered(self.stamp(event))


def frame_numbered(event: dict[str, Any]) -> bytes:
    """One SSE frame of an event that already carries its ``sequence_number``."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
