"""Create-time checks for ``POST /v1/responses``.

Everything a request can be refused for without a model is refused here, before anything reaches
a worker, with the OpenAI error shape and the parameter that is wrong. The result is a frozen
``create_request.CreateRequest``: ``input`` is always a list of items and ``stream`` a boolean.

It holds the fields the API defines and nothing else: any other key is ignored, as OpenAI's SDKs
let clients send extra fields freely (``extra_body``), and that is also what keeps a client away
from what a door decides for itself (``options.DoorOptions``: a raw prompt, a session key), which
has no attribute on the request.
"""

from __future__ import annotations

from typing import Any

from kiln.protocol.request import MAX_SEED, MAX_TOP_LOGPROBS, InvalidParam, ToolChoice

from ..http.errors import invalid
from .create_request import CreateRequest
from .schema_check import check_json_schema, check_text_format

HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "computer_use_preview",
        "computer_use",
        "code_interpreter",
        "image_generation",
        "mcp",
        "custom",
        "apply_patch",
        "function_shell",
        "shell",
        "local_shell",
    }
)
MAX_TOOLS = 128
MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
INPUT_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning", "compaction", "compaction_trigger", "item_reference"})
# Documented ``include`` values Kiln can honour; the others name hosted tools or images.
INCLUDE_SUPPORTED = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content"})
INCLUDE_UNSUPPORTED = {
    "message.input_image.image_url": "this model takes text only, so there are no input images to include",
    "computer_call_output.output.image_url": "hosted tools are not available on this server",
    "file_search_call.results": "hosted tools are not available on this server",
    "web_search_call.results": "hosted tools are not available on this server",
    "web_search_call.action.sources": "hosted tools are not available on this server",
    "code_interpreter_call.outputs": "hosted tools are not available on this server",
}
SERVICE_TIERS = frozenset({"auto", "default", "flex", "scale", "priority"})
CONTENT_PART_TYPES = frozenset({"input_text", "output_text", "refusal", "text", "summary_text"})


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


def _expect(body: dict[str, Any], key: str, kinds: tuple[type, ...], label: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    # bool is an int in Python; JSON keeps them apart and so do we.
    if isinstance(value, bool) and bool not in kinds:
        raise invalid(f"Invalid type for '{key}': expected {label}, but got a boolean.", param=key)
    if not isinstance(value, kinds):
        raise invalid(f"Invalid type for '{key}': expected {label}, but got {_type_name(value)}.", param=key)
    return value


def _number_in(body: dict[str, Any], key: str, low: float, high: float) -> None:
    value = _expect(body, key, (int, float), "a number")
    if value is not None and not low <= value <= high:
        raise invalid(f"Invalid '{key}': {value} is out of range; expected a value from {low} to {high}.", param=key)


def _int_in(body: dict[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    """An optional integer field (never a boolean or a float) within ``low``..``high``."""
    value: int | None = _expect(body, key, (int,), "an integer")
    if value is None:
        return None
    if value < low:
        raise invalid(
            f"Invalid '{key}': integer below minimum value. Expected a value >= {low}, but got {value} instead.",
            param=key,
            code="integer_below_min_value",
        )
    if high is not None and value > high:
        raise invalid(
            f"Invalid '{key}': integer above maximum value. Expected a value <= {high}, but got {value} instead.",
            param=key,
            code="integer_above_max_value",
        )
    return value


def check_metadata(metadata: Any) -> dict[str, Any] | None:
    """OpenAI's metadata: up to 16 string values, keys up to 64 and values up to 512 characters."""
    checked: dict[str, Any] | None = _expect({"metadata": metadata}, "metadata", (dict,), "an object")
    if checked is not None:
        if len(checked) > 16:
            raise invalid("Invalid 'metadata': at most 16 keys are allowed.", param="metadata")
        for key, value in checked.items():
            if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
                raise invalid("Invalid 'metadata': keys up to 64 characters and string values up to 512.", param="metadata")
    return checked


def _check_include(body: dict[str, Any]) -> list[str]:
    """``include`` holds known values only: a typo must not pass silently, and a value Kiln
    cannot honour (images, hosted tools) is refused with the reason rather than ignored."""
    include: list[str] | None = _expect(body, "include", (list,), "an array")
    if include is None:
        return []
    for i, value in enumerate(include):
        param = f"include[{i}]"
        if not isinstance(value, str):
            raise invalid(f"Invalid type for '{param}': expected a string.", param=param)
        if value in INCLUDE_UNSUPPORTED:
            raise invalid(f"'include' value {value!r} is not supported: {INCLUDE_UNSUPPORTED[value]}.", param=param)
        if value not in INCLUDE_SUPPORTED:
            raise invalid(f"Invalid value for '{param}': {value!r} is not a known include value; supported: {', '.join(sorted(INCLUDE_SUPPORTED))}.", param=param)
    return include


def check_for_model(request: CreateRequest, context_window: int | None) -> None:
    """The checks that need the model: ``max_output_tokens`` must fit its context window.

    Called once the model is resolved (``ResponsesService.prepare``); ``None`` or 0 means the
    worker did not say, and the worker's own clamp applies.
    """
    if context_window:
        _int_in({"max_output_tokens": request.max_output_tokens}, "max_output_tokens", 1, context_window)


def parse_bool(value: Any, key: str) -> bool:
    """A JSON boolean; also "true"/"false" strings and 0/1, which some clients send."""
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    if value in ("true", 1, "1"):
        return True
    if value in ("false", 0, "0"):
        return False
    raise invalid(f"Invalid type for '{key}': expected a boolean, but got {_type_name(value)}.", param=key)


def normalize_input(value: Any) -> list[dict[str, Any]]:
    """``input`` as a list of items, with each item checked for a known shape."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise invalid(f"Invalid type for 'input': expected a string or an array of items, but got {_type_name(value)}.", param="input")
    items = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"Invalid type for '{param}': expected an object.", param=param)
        kind = item.get("type")
        if kind is None and "role" in item:
            item = {**item, "type": "message"}
            kind = "message"
        if not isinstance(kind, str) or kind not in INPUT_ITEM_TYPES:  # a list or map hashes not
            raise invalid(f"Invalid value for '{param}.type': {kind!r} is not a supported input item type.", param=f"{param}.type")
        if kind == "message":
            _check_message(item, param)
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str):
                    raise invalid(f"Missing or invalid '{param}.{key}'.", param=f"{param}.{key}")
            if not isinstance(item.get("arguments", ""), str):
                raise invalid(f"Invalid type for '{param}.arguments': expected a string.", param=f"{param}.arguments")
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"Missing or invalid '{param}.call_id'.", param=f"{param}.call_id")
            if not isinstance(item.get("output"), (str, list)):
                raise invalid(f"Invalid type for '{param}.output': expected a string.", param=f"{param}.output")
        items.append(item)
    return items


def _check_message(item: dict[str, Any], param: str) -> None:
    role = item.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise invalid(f"Invalid value for '{param}.role': {role!r}; expected one of user, assistant, system, developer.", param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid(f"Invalid type for '{param}.content': expected a string or an array of content parts.", param=f"{param}.content")
    for j, part in enumerate(content):
        p = f"{param}.content[{j}]"
        if not isinstance(part, dict):
            raise invalid(f"Invalid type for '{p}': expected an object.", param=p)
        kind = part.get("type")
        if kind in ("input_image", "input_file", "input_audio"):
            raise invalid(f"'{p}.type' {kind!r} is not supported: this model takes text only.", param=f"{p}.type")
        if not isinstance(kind, str) or kind not in CONTENT_PART_TYPES:
            raise invalid(f"Invalid value for '{p}.type': {kind!r} is not a supported content part type.", param=f"{p}.type")
        field = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(field), str):
            raise invalid(f"Missing or invalid '{p}.{field}': expected a string.", param=f"{p}.{field}")


def _check_tools(body: dict[str, Any], hosted_tools: str) -> list[dict[str, Any]]:
    tools = _expect(body, "tools", (list,), "an array")
    if not tools:
        return []
    kept = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"Invalid type for '{param}': expected an object.", param=param)
        kind = tool.get("type")
        if isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:
            if hosted_tools == "drop":
                continue
            raise invalid(f"Tool type '{kind}' is not supported: this server runs function tools only; hosted tools are not available.", param=f"{param}.type")
        if kind == "function":
            _check_function(tool, param)
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(inner, list):
                raise invalid(f"Invalid namespace tool '{param}': needs 'name' and 'tools'.", param=param)
            for j, fn in enumerate(inner):
                if not isinstance(fn, dict) or fn.get("type", "function") != "function":
                    raise invalid(f"Invalid tool '{param}.tools[{j}]': a namespace holds functions only.", param=f"{param}.tools[{j}]")
                _check_function(fn, f"{param}.tools[{j}]")
        else:
            raise invalid(f"Invalid value for '{param}.type': {kind!r} is not a supported tool type.", param=f"{param}.type")
        kept.append(tool)
    if sum(len(t.get("tools", [])) if t["type"] == "namespace" else 1 for t in kept) > MAX_TOOLS:
        raise invalid(f"Too many tools: at most {MAX_TOOLS} functions may be declared.", param="tools")
    return kept


def _check_function(tool: dict[str, Any], param: str) -> None:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"Missing required parameter: '{param}.name'.", param=f"{param}.name", code="missing_required_parameter")
    params = tool.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise invalid(f"Invalid type for '{param}.parameters': expected an object.", param=f"{param}.parameters")
    if params:
        check_json_schema(params, param=f"{param}.parameters", use="tool_arguments")


def function_names(tools: list[dict[str, Any]]) -> set[str]:
    names: set[str] = set()
    for tool in tools:
        if tool.get("type") == "namespace":
            names.update(fn["name"] for fn in tool["tools"])
        elif tool.get("type") == "function":
            names.add(tool["name"])
    return names


def _check_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> Any:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid(f"Invalid value for 'tool_choice': {choice!r}.", param="tool_choice")
        if choice == "required" and not tools:
            raise invalid("'tool_choice' is 'required' but no tools were declared.", param="tool_choice")
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            name = choice.get("name")
            if not isinstance(name, str) or name not in function_names(tools):
                raise invalid(f"'tool_choice' names function {name!r}, which is not among the declared tools.", param="tool_choice")
            return choice
        if kind == "allowed_tools":
            try:
                parsed = ToolChoice.from_api(choice)  # the worker's reading of the subset
            except InvalidParam as exc:
                raise invalid(exc.message, param=exc.param) from None
            # In required mode a call is forced: to a declared function of the subset.
            if parsed.mode == "required" and not set(parsed.allowed or ()) & function_names(tools):
                raise invalid("'tool_choice' is 'allowed_tools' in 'required' mode, but none of its tools is a declared function.", param="tool_choice")
            return choice
        if isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:  # a list or map is no type name
            raise invalid(f"'tool_choice' type {kind!r} is not supported.", param="tool_choice")
    raise invalid("Invalid value for 'tool_choice'.", param="tool_choice")


def validate_create(body: Any, *, hosted_tools: str = "reject", truncation_auto: bool = False) -> CreateRequest:
    """Check a create body and return it as a ``CreateRequest`` (the fields of
    ``create_request.DROPPED_FIELDS`` and unknown keys are dropped); raise ApiError on the first
    fault. ``truncation_auto``: the gateway accepts ``truncation: "auto"`` (--truncation-auto)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    model = body.get("model")
    if model is None:
        raise invalid("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    _expect(body, "model", (str,), "a string")
    _expect(body, "instructions", (str,), "a string")
    # OpenAI's minimum is 16; Kiln keeps 1, which clients use for cheap probes (and tests rely on).
    _int_in(body, "max_output_tokens", 1)
    _int_in(body, "seed", 0, MAX_SEED)  # the typed request's bound: the worker's 64-bit PRNG key, signed-safe
    _int_in(body, "max_tool_calls", 1)
    _number_in(body, "temperature", 0, 2)
    _number_in(body, "top_p", 0, 1)
    _number_in(body, "presence_penalty", -2, 2)
    _number_in(body, "frequency_penalty", -2, 2)
    service_tier = _expect(body, "service_tier", (str,), "a string")
    if service_tier is not None and service_tier not in SERVICE_TIERS:
        raise invalid(f"Invalid value for 'service_tier': {service_tier!r}; expected one of {', '.join(sorted(SERVICE_TIERS))}.", param="service_tier")
    safety_identifier = _expect(body, "safety_identifier", (str,), "a string")
    if safety_identifier is not None and len(safety_identifier) > 64:
        raise invalid("Invalid 'safety_identifier': at most 64 characters.", param="safety_identifier")
    top_logprobs = _expect(body, "top_logprobs", (int,), "an integer")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid(f"Invalid 'top_logprobs': {top_logprobs} is out of range; expected 0 to {MAX_TOP_LOGPROBS}.", param="top_logprobs")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled") and not (truncation == "auto" and truncation_auto):
        raise invalid(f"Invalid value for 'truncation': only 'disabled' is supported, got {truncation!r}.", param="truncation")
    stream = parse_bool(body.get("stream"), "stream")
    store = True if body.get("store") is None else parse_bool(body.get("store"), "store")
    background = parse_bool(body.get("background"), "background")
    parallel_tool_calls = True if body.get("parallel_tool_calls") is None else parse_bool(body.get("parallel_tool_calls"), "parallel_tool_calls")
    metadata = check_metadata(body.get("metadata"))
    text, reasoning = (_expect(body, key, (dict,), "an object") for key in ("text", "reasoning"))
    if text is not None:
        check_text_format(text.get("format"))
    include = _check_include(body)
    previous_response_id = _expect(body, "previous_response_id", (str,), "a string")
    conversation = _expect(body, "conversation", (str, dict), "a string or an object")
    prompt_cache_key = _expect(body, "prompt_cache_key", (str,), "a string")
    items = normalize_input(body.get("input"))
    tools = _check_tools(body, hosted_tools)
    tool_choice = _check_tool_choice(body, tools)
    if stream and background:
        raise invalid("'background' and 'stream' cannot both be true.", param="background")
    return CreateRequest(
        model=model, input=items, instructions=body.get("instructions"), max_output_tokens=body.get("max_output_tokens"),
        max_tool_calls=body.get("max_tool_calls"), temperature=body.get("temperature"), top_p=body.get("top_p"),
        presence_penalty=body.get("presence_penalty"), frequency_penalty=body.get("frequency_penalty"), seed=body.get("seed"),
        top_logprobs=top_logprobs, stream=stream, store=store, background=background, parallel_tool_calls=parallel_tool_calls,
        tools=tools, tool_choice=tool_choice, text=text, reasoning=reasoning, include=include, metadata=metadata,
        previous_response_id=previous_response_id, conversation=conversation, prompt_cache_key=prompt_cache_key, safety_identifier=safety_identifier,
        truncation=truncation, context_management=body.get("context_management"),
    )
