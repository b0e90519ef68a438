"""Assertions that what Kiln sends matches the official OpenAI Responses schema.

Every test that looks at a Response object, a stream event or an error body goes through these
helpers, so conformance is checked everywhere rather than in one place.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

SCHEMA_PATH = Path(__file__).with_name("openai-responses.schema.json")
EXTRA_ERROR_CODES = ["context_length_exceeded", "server_is_overloaded", "server_overloaded"]


# The whole-API bundle (Chat Completions, Conversations, WebSocket frames, ... and Responses).
API_SCHEMA_PATH = Path(__file__).with_name("openai-api.schema.json")


@cache
def _bundle(path: Path) -> dict:
    """A schema bundle, read once, with Kiln's documented extra error codes allowed."""
    bundle = json.loads(path.read_text())
    codes = bundle["$defs"]["ResponseErrorCode"]["enum"]
    codes.extend(c for c in EXTRA_ERROR_CODES if c not in codes)
    return bundle


@cache
def _validator(ref: str, path: Path = SCHEMA_PATH) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**_bundle(path), "$ref": f"#/$defs/{ref}"})


def _check(ref: str, obj: Any, path: Path = SCHEMA_PATH) -> None:
    error = best_match(_validator(ref, path).iter_errors(obj))
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path)
        raise AssertionError(f"{ref} does not conform at '{path}': {error.message}\n{json.dumps(obj)[:2000]}")


def assert_response(obj: dict, *, terminal: bool = True) -> None:
    """A Response object; before it is terminal ``usage`` may be null or absent."""
    assert obj.get("object") == "response", obj
    if not terminal and obj.get("usage") is None:
        obj = {k: v for k, v in obj.items() if k != "usage"}
    _check("Response", obj)


def assert_event(event: dict) -> None:
    kind = event.get("type", "")
    if kind.startswith("mlx."):  # Kiln's documented extension events (compaction)
        assert isinstance(event.get("sequence_number"), int)
        return
    if "response" in event and event["response"].get("usage") is None:
        event = copy.deepcopy(event)
        event["response"].pop("usage", None)
    _check("ResponseStreamEvent", event)


def assert_error(body: dict) -> None:
    _check("ErrorResponse", body)
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body


def assert_stream(events: list[dict], names: list[str] | None = None) -> None:
    """A whole stream: each event valid, sequence numbers rising by one, SSE names matching
    types, item events only between their item's added and done."""
    assert events, "empty stream"
    if names is not None:
        assert names == [e["type"] for e in events], "SSE event names differ from data types"
    for i, event in enumerate(events):
        assert_event(event)
        assert event["sequence_number"] == events[0]["sequence_number"] + i, "sequence_number not monotonic"
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    open_items: dict[int, str] = {}
    done_items: set[int] = set()
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] not in open_items and event["output_index"] not in done_items
            open_items[event["output_index"]] = event["item"].get("id")
        elif kind == "response.output_item.done":
            assert event["output_index"] in open_items, "done without added"
            done_items.add(event["output_index"])
            del open_items[event["output_index"]]
        elif "output_index" in event:
            assert event["output_index"] in open_items, f"{kind} outside its item"
            if "item_id" in event:
                assert event["item_id"] == open_items[event["output_index"]]
    final = events[-1]["response"]
    if final["status"] in ("completed", "incomplete"):
        assert not open_items, "items left open"
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [i.get("id") for i in final["output"]] == [i.get("id") for i in done]


def assert_api_object(ref: str, obj: Any) -> None:
    """An object against the whole-API bundle (Conversations, Chat Completions, WebSocket frames
    as well as Responses): ``ref`` names its ``$defs`` component, e.g. ``ConversationResource``."""
    _check(ref, obj, API_SCHEMA_PATH)


def assert_component(obj: Any, ref: str) -> None:
    """``obj`` conforms to ``$defs/<ref>`` of the whole-API bundle, e.g. CreateChatCompletionResponse."""
    assert_api_object(ref, obj)


# Neither bundle has the Model object (GET /v1/models is outside the Responses extract). OpenAI's
# API reference defines it as these four fields, all required, with no closed property list, so
# the fields Kiln adds (docs/api.md#models) keep it valid; written out here as the reference says.
MODEL_SCHEMA = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
    },
}
MODEL_LIST_SCHEMA = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL_SCHEMA}},
}


def assert_model(obj: Any) -> None:
    """One model object of ``GET /v1/models/{model}``."""
    jsonschema.validate(obj, MODEL_SCHEMA)


def assert_model_list(obj: Any) -> None:
    """The body of ``GET /v1/models``."""
    jsonschema.validate(obj, MODEL_LIST_SCHEMA)
