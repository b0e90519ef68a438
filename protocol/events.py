"""The Responses stream events a worker sends in ``Event.events``, typed once for both daemons.

The worker owns everything that needs tokens, so it emits the output-item events of a response
(an item's ``added``, its content part, its deltas, their ``done`` and the item's ``done``); the
gateway adds the envelope (``response.created`` ... ``response.completed``), sequence numbers and
the Response object. The shapes are OpenAI's streaming event schemas less ``sequence_number``
(shared/conformance/openai-responses.schema.json), narrowed to what the worker emits: text
parts are ``output_text``, reasoning streams as ``reasoning_text``, calls are function calls.

On the wire an event is a plain msgpack map: these are static types only. A worker may be
hostile, and nothing here checks a map's shape at runtime (the pool checks that ``events`` is a
list of maps, gateway/pool/workers.py). So readers keep their tolerance: the ``is_*`` guards
below narrow the union by ``event.get("type")``, never ``event["type"]``, so a map without a type
is an event no reader recognises (as it always was), not a ``KeyError``.

Output items stay JSON maps (``OutputItem``): the gateway stores them, rewrites them (sealed
reasoning) and makes its own (compaction items placed before the worker's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, TypedDict, TypeGuard

# The event types a worker may send, in the one place both daemons read them from. Each is the
# ``type`` of one TypedDict below (tests/test_protocol_events.py holds the two together).
OUTPUT_ITEM_ADDED: Final = "response.output_item.added"
OUTPUT_ITEM_DONE: Final = "response.output_item.done"
CONTENT_PART_ADDED: Final = "response.content_part.added"
CONTENT_PART_DONE: Final = "response.content_part.done"
OUTPUT_TEXT_DELTA: Final = "response.output_text.delta"
OUTPUT_TEXT_DONE: Final = "response.output_text.done"
REASONING_TEXT_DELTA: Final = "response.reasoning_text.delta"
REASONING_TEXT_DONE: Final = "response.reasoning_text.done"
FUNCTION_CALL_ARGUMENTS_DELTA: Final = "response.function_call_arguments.delta"
FUNCTION_CALL_ARGUMENTS_DONE: Final = "response.function_call_arguments.done"

# A Responses output item (message, reasoning, function_call; compaction from the gateway).
OutputItem = dict[str, Any]


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class Logprob(TypedDict):
    """One generated token's log probability and its most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class OutputTextPart(TypedDict):
    """A message's content part, empty when added and whole when done."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[Logprob]


class OutputItemAdded(TypedDict):
    type: Literal["response.output_item.added"]
    output_index: int
    item: OutputItem


class OutputItemDone(TypedDict):
    type: Literal["response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartAdded(TypedDict):
    type: Literal["response.content_part.added"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputTextPart


class ContentPartDone(TypedDict):
    type: Literal["response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputTextPart


class OutputTextDelta(TypedDict):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Logprob]


class OutputTextDone(TypedDict):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Logprob]


class ReasoningTextDelta(TypedDict):
    type: Literal["response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(TypedDict):
    type: Literal["response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(TypedDict):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(TypedDict):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str


WorkerEvent = (
    OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
)


# -- narrowing, tolerant of a map without a type (see the module docstring) ------------------------
def is_item_added(event: Mapping[str, object]) -> TypeGuard[OutputItemAdded]:
    return event.get("type") == OUTPUT_ITEM_ADDED


def is_item_done(event: Mapping[str, object]) -> TypeGuard[OutputItemDone]:
    return event.get("type") == OUTPUT_ITEM_DONE


def is_text_delta(event: Mapping[str, object]) -> TypeGuard[OutputTextDelta]:
    return event.get("type") == OUTPUT_TEXT_DELTA


def is_reasoning_delta(event: Mapping[str, object]) -> TypeGuard[ReasoningTextDelta]:
    return event.get("type") == REASONING_TEXT_DELTA


def is_arguments_delta(event: Mapping[str, object]) -> TypeGuard[FunctionCallArgumentsDelta]:
    return event.get("type") == FUNCTION_CALL_ARGUMENTS_DELTA
