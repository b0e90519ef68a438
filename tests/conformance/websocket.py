"""Conformance of WebSocket mode frames: every server frame validates as ``ResponsesServerEvent``
in the wider official bundle (``openai-api.schema.json``, vendored from ../shared/conformance,
same commit as ``openai-responses.schema.json``), with the same relaxation as the SSE helpers
(``usage`` may be null or absent before a response is terminal), and a turn's frames obey the
stream rules ``assert_stream`` checks.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from . import EXTRA_ERROR_CODES, assert_stream

BUNDLE_PATH = Path(__file__).with_name("openai-api.schema.json")


@lru_cache(maxsize=1)
def _bundle() -> dict:
    bundle = json.loads(BUNDLE_PATH.read_text())
    codes = bundle["$defs"]["ResponseErrorCode"]["enum"]
    codes.extend(c for c in EXTRA_ERROR_CODES if c not in codes)
    return bundle


@lru_cache(maxsize=None)
def _validator(ref: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**_bundle(), "$ref": f"#/$defs/{ref}"})


def assert_ws_frame(frame: Any) -> None:
    """One server frame (already parsed) is a ResponsesServerEvent."""
    assert isinstance(frame, dict), frame
    if isinstance(frame.get("response"), dict) and frame["response"].get("usage") is None:
        frame = copy.deepcopy(frame)
        frame["response"].pop("usage", None)
    error = best_match(_validator("ResponsesServerEvent").iter_errors(frame))
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path)
        raise AssertionError(f"ResponsesServerEvent does not conform at '{path}': {error.message}\n{json.dumps(frame)[:2000]}")


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
