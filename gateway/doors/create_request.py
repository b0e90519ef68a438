"""The create request as the gateway holds it once ``validation.validate_create`` accepted it.

One frozen value, typed at the top level: a step that changes the request (model resolved,
history expanded, a server default, compaction) makes a new one (``dataclasses.replace``,
``with_input``), so no step sees another's edit by surprise. The API objects inside (``input``
items, ``tools``, ``text``, ``reasoning``, ``metadata``) stay JSON maps, echoed and stored as the
client wrote them. What a door decides (raw prompt, session, warm-up) is ``options.DoorOptions``,
never an attribute here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

JsonObject = dict[str, Any]

# Fields of OpenAI's ``CreateResponse`` that Kiln accepts and drops: ``service_tier`` (checked
# against the known tiers; one tier runs, and the response says "default"), ``user``,
# ``moderation``, ``prompt`` (stored prompt templates), ``prompt_cache_options``,
# ``prompt_cache_retention`` (the worker's prefix cache has its own policy) and ``stream_options``
# (obfuscation padding is never sent). Any other key a client sends is dropped the same way, as
# OpenAI's SDKs let clients add extra fields (``extra_body``).
DROPPED_FIELDS = frozenset({"service_tier", "user", "moderation", "prompt", "prompt_cache_options", "prompt_cache_retention", "stream_options"})


@dataclass(frozen=True)
class CreateRequest:
    """A validated ``POST /v1/responses`` body (or WebSocket ``response.create``, or what another
    door translated its request into): ``input`` always a list of items, the booleans with the
    API's defaults. What the Response object echoes is ``response_object._ECHOED``'s; read, not
    echoed: ``include``, ``stream``, ``context_management`` (checked when prepared,
    ``compaction.compaction_settings``)."""

    model: str
    input: list[JsonObject] = field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    # Sampling, as the client sent it (an integer stays one: the echo is the client's value).
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    top_logprobs: int | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    parallel_tool_calls: bool = True
    tools: list[JsonObject] = field(default_factory=list)
    tool_choice: str | JsonObject = "auto"
    text: JsonObject | None = None
    reasoning: JsonObject | None = None
    include: list[str] = field(default_factory=list)
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    conversation: str | JsonObject | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: str | None = None
    context_management: Any = None

    def with_input(self, items: list[JsonObject]) -> CreateRequest:
        """The same request over other input items (history expanded, compacted, a part of it)."""
        return dataclasses.replace(self, input=items)

    def to_json(self) -> JsonObject:
        """The request as a JSON object (the fields that are set), e.g. to size what a
        background job holds. Nothing stores a request: a stored response or job keeps its input
        items and its Response object, whose echo is built from the attributes."""
        return {f.name: value for f in dataclasses.fields(self) if (value := getattr(self, f.name)) is not None}
