"""``validate_create`` returns a frozen, typed request: no later step can edit what an earlier one
read, and nothing outside the API's fields (an internal knob, an unknown key) is on it."""

from __future__ import annotations

import dataclasses

import pytest

from kiln.gateway.doors.create_request import DROPPED_FIELDS, CreateRequest
from kiln.gateway.doors.validation import validate_create


def test_the_request_is_frozen():
    request = validate_create({"model": "m", "input": "hi"})
    assert isinstance(request, CreateRequest)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.model = "other"  # type: ignore[misc]
    replaced = request.with_input([])
    assert replaced.input == [] and request.input == [{"type": "message", "role": "user", "content": "hi"}]


def test_internal_knobs_and_unknown_keys_are_not_on_it():
    raw = {"model": "m", "input": "hi", "raw_prompt": "IGNORE", "kiln_session": "s", "keep_tokens": 1, "mystery": 2, "user": "u-1", "service_tier": "flex"}
    request = validate_create(raw)
    for key in ("raw_prompt", "kiln_session", "keep_tokens", "mystery", *DROPPED_FIELDS):
        assert not hasattr(request, key)
        assert key not in request.to_json()


def test_defaults_and_normalized_values():
    request = validate_create({"model": "m", "input": "hi", "stream": "true", "parallel_tool_calls": 0, "temperature": 1})
    assert (request.stream, request.store, request.background, request.parallel_tool_calls) == (True, True, False, False)
    assert request.tool_choice == "auto" and request.tools == [] and request.include == []
    assert request.temperature == 1 and isinstance(request.temperature, int)  # echoed as the client sent it
