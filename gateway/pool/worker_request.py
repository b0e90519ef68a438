"""The one place a validated create body becomes the typed request a worker gets.

Every door (Responses over HTTP or WebSocket, Chat Completions, legacy Completions, Anthropic
Messages) turns its request into a Responses create body, which ``validation.validate_create``
checks into a ``CreateRequest`` and ``ResponsesService.prepare`` completes (model resolved,
history expanded). What the worker is sent, for ``Generate``, ``CountTokens`` and ``Compact``
alike, is built here from that request and the input items as the worker renders them (compaction items expanded): tools
flattened with their namespace, the tool mode, the text format, sampling (range-checked by
``kiln.protocol.request``'s constructors), the cache key.

A value the typed request refuses is a 400 ``invalid_request_error`` naming the parameter, raised
before anything is sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiln.protocol.request import (
    EMPTY_PARAMETERS,
    ContentPart,
    FunctionCall,
    FunctionCallOutput,
    GenerateRequest,
    InputItem,
    InvalidParam,
    Marker,
    Message,
    Reasoning,
    Sampling,
    TextFormat,
    ToolChoice,
    ToolSpec,
)

from ..doors.create_request import CreateRequest
from ..doors.options import NO_OPTIONS, DoorOptions
from ..http.errors import ApiError, invalid

LOGPROBS_INCLUDE = "message.output_text.logprobs"
SAMPLING_FIELDS = ("temperature", "top_p", "top_logprobs", "seed", "max_output_tokens", "presence_penalty", "frequency_penalty")


def worker_request(request: CreateRequest, items: Sequence[Mapping[str, Any]] | None = None, options: DoorOptions = NO_OPTIONS) -> GenerateRequest:
    """The worker's request for ``request`` (client fields) and ``options`` (the door's
    decisions); ``items`` replaces ``request.input`` (the expanded form).

    Raises ApiError(400) naming the parameter for a value the worker could not honour."""
    try:
        return GenerateRequest(
            model=request.model,
            input=input_items(request.input if items is None else items),
            instructions=request.instructions,
            tools=tool_specs(request.tools),
            tool_choice=ToolChoice.from_api(request.tool_choice),
            parallel_tool_calls=request.parallel_tool_calls,
            max_tool_calls=request.max_tool_calls,
            text_format=text_format(request.text),
            sampling=sampling(request, warm_up=options.warm_up),
            cache_key=request.prompt_cache_key,
            raw_prompt=options.raw_prompt,
        )
    except InvalidParam as exc:
        raise refusal(exc) from None


def check_sampling(request: CreateRequest) -> None:
    """Refuse bad sampling values when the request is prepared, before compaction or any other
    work on its behalf (the worker's request is built when it is sent)."""
    try:
        sampling(request)
    except InvalidParam as exc:
        raise refusal(exc) from None


def refusal(exc: InvalidParam) -> ApiError:
    return invalid(exc.message, param=exc.param)


def sampling(request: CreateRequest, *, warm_up: bool = False) -> Sampling:
    """The request's sampling settings; unset fields take the protocol's defaults (the worker's
    default ``max_output_tokens``). A warm-up asks for one token: the prefill is what it is for."""
    given = {name: value for name in SAMPLING_FIELDS if (value := getattr(request, name)) is not None}
    if warm_up:
        given["max_output_tokens"] = 1
    logprobs = bool(given.get("top_logprobs")) or LOGPROBS_INCLUDE in request.include
    return Sampling(**given, logprobs=logprobs)


def tool_specs(tools: Sequence[Mapping[str, Any]]) -> tuple[ToolSpec, ...]:
    """Declared function tools, flat: a namespace's functions carry its name."""
    out: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "function")
        if kind == "namespace":
            out.extend(_function(fn, f"tools[{i}].tools[{j}]", tool.get("name")) for j, fn in enumerate(tool.get("tools") or []))
        elif kind == "function":
            out.append(_function(tool, f"tools[{i}]", None))
        # validate_create admitted no other kind (hosted tools are refused or dropped there).
    return tuple(out)


def _function(tool: Mapping[str, Any], param: str, namespace: Any) -> ToolSpec:
    description = tool.get("description") or ""
    if not isinstance(description, str):
        raise InvalidParam(f"{param}.description", f"Invalid type for '{param}.description': expected a string.")
    return ToolSpec(
        name=tool.get("name"),  # type: ignore[arg-type]  # any value: ToolSpec refuses a non-string name
        parameters=tool.get("parameters") or dict(EMPTY_PARAMETERS),
        description=description,
        namespace=namespace,
        # The Responses API's function tools are strict unless they say otherwise.
        strict=tool.get("strict") is not False,
    )


def text_format(text: Any) -> TextFormat:
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if not isinstance(fmt, Mapping):
        return TextFormat()
    return TextFormat(type=fmt.get("type", "text"), name=fmt.get("name"), schema=fmt.get("schema"), strict=fmt.get("strict"))


def input_items(items: Sequence[Mapping[str, Any]]) -> tuple[InputItem, ...]:
    """One typed item per item (none dropped: ``Compacted`` answers with positions)."""
    return tuple(_item(item) for item in items)


def _item(item: Mapping[str, Any]) -> InputItem:
    kind = item.get("type", "message")
    if kind == "message":
        return Message(item.get("role", "user"), content_parts(item.get("content")))
    if kind == "function_call":
        return FunctionCall(item.get("call_id") or "", item.get("name") or "", item.get("arguments") or "")
    if kind == "function_call_output":
        output = item.get("output")
        return FunctionCallOutput(item.get("call_id") or "", output if isinstance(output, str) else _text(content_parts(output)))
    if kind == "reasoning":
        return Reasoning("".join(c.get("text", "") for c in item.get("content") or [] if isinstance(c, Mapping)))
    return Marker(str(kind))


def content_parts(content: Any) -> tuple[ContentPart, ...]:
    """A message's ``content`` (a string or text-bearing parts) as parts; a refusal's text is
    its refusal."""
    if content is None:
        return ()
    if isinstance(content, str):
        return (ContentPart("input_text", content),)
    parts = []
    for part in content:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type") or "text"
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        parts.append(ContentPart(str(kind), text if isinstance(text, str) else ""))
    return tuple(parts)


def _text(parts: tuple[ContentPart, ...]) -> str:
    return "".join(p.text for p in parts)
