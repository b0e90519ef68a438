"""Conformance of WebSocket mode frames: every server frame validates as ``ResponsesServerEvent``
in the wider official bundle (``openai-api.schema.json``, vendored from ../shared/conformance,
same commit as ``openai-responses.schema.json``), with the same relaxation as the SSE helpers
(``usage`` may be null or absent before a response is terminal), and a turn's frames obey the
stream rules ``assert_stream`` checks.
"""

from __future__ import annotations

import copy
from typing import Any

from . import assert_api_object, assert_stream


def assert_ws_frame(frame: Any) -> None:
    """One server frame (already parsed) is a ResponsesServerEvent."""
    assert isinstance(frame, dict), frame
    if isinstance(frame.get("response"), dict) and frame["response"].get("usage") is None:
        frame = copy.deepcopy(frame)
        frame["response"].pop("usage", None)
    assert_api_object("ResponsesServerEvent", frame)


def assert_ws_error(frame: dict) -> None:
    """An error frame: the schema's ResponseWsError, with the HTTP status and a full error object."""
    assert frame.get("type") == "error", frame
    assert_ws_frame(frame)
    assert isinstance(frame.get("status"), int), frame
    assert set(frame["error"]) >= {"type", "code", "message", "param"}, frame


def assert_ws_turn(frames: list[dict]) -> None:
    """A whole turn: each frame valid, and the SSE stream rules (numbering from 0, order)."""
    for frame in frames:
        assert_ws_frame(frame)
    assert frames[0]["sequence_number"] == 0, frames[0]
    assert_stream(frames)
