"""Chat Completions request -> a Responses create body (the typed request contract).

The Chat door translates and nothing more: the translated body goes through the same
``validate_create`` as ``/v1/responses``, so models, tools, grammars, sampling limits and hosted
admission behave the same whichever door a request came through. What Chat has and Responses
lacks is kept beside the body in ``ChatRequest``: ``stop`` (cut in the door) and the streaming
options. Chat completions are never stored (``store`` is forced off).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...http.errors import invalid
from ..validation import parse_bool

MAX_STOP = 4
LOGPROBS_INCLUDE = "message.output_text.logprobs"
PASSED = ("model", "temperature", "top_p", "seed", "metadata", "parallel_tool_calls", "prompt_cache_key")


@dataclass
class ChatRequest:
    """A translated chat request: the Responses body plus what only the door handles."""

    body: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    stop: list[str] = field(default_factory=list)
    # The legacy Completions door's prompt, continued as raw text (no chat template).
    raw_prompt: str | None = None


def _text_of(content: Any, param: str, *, allow_refusal: bool = False) -> str:
    """A message's content as text: a string, or text parts (refusal parts on assistant turns)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"Invalid type for '{param}': expected a string or an array of content parts.", param=param)
    pieces = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid(f"Invalid type for '{p}': expected an object.", param=p)
        kind = part.get("type")
        if kind in ("image_url", "input_audio", "file"):
            raise invalid(f"'{p}.type' {kind!r} is not supported: this model takes text only.", param=f"{p}.type")
        key = "refusal" if (kind == "refusal" and allow_refusal) else "text" if kind == "text" else None
        if key is None:
            raise invalid(f"Invalid value for '{p}.type': {kind!r} is not a supported content part type.", param=f"{p}.type")
        if not isinstance(part.get(key), str):
            raise invalid(f"Missing or invalid '{p}.{key}': expected a string.", param=f"{p}.{key}")
        pieces.append(part[key])
    return "".join(pieces)


def _assistant_items(message: dict[str, Any], param: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    text = _text_of(message.get("content"), f"{param}.content", allow_refusal=True)
    if text:
        items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
    calls = message.get("tool_calls")
    if calls is None:
        return items
    if not isinstance(calls, list):
        raise invalid(f"Invalid type for '{param}.tool_calls': expected an array.", param=f"{param}.tool_calls")
    for k, call in enumerate(calls):
        p = f"{param}.tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str):
            raise invalid(f"Invalid '{p}': expected an object with 'id' and 'function.name'.", param=p)
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):
            raise invalid(f"Invalid type for '{p}.function.arguments': expected a string.", param=f"{p}.function.arguments")
        items.append({"type": "function_call", "call_id": call["id"], "name": fn["name"], "arguments": arguments})
    return items


def messages_to_input(messages: Any) -> list[dict[str, Any]]:
    """Chat ``messages`` as Responses input items (tool calls and results become their items)."""
    if not isinstance(messages, list) or not messages:
        raise invalid("Missing required parameter: 'messages'.", param="messages", code="missing_required_parameter")
    items: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"Invalid type for '{param}': expected an object.", param=param)
        role = message.get("role")
        if role in ("system", "developer", "user"):
            text = _text_of(message.get("content"), f"{param}.content")
            items.append({"type": "message", "role": role, "content": text})
        elif role == "assistant":
            items.extend(_assistant_items(message, param))
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise invalid(f"Missing required parameter: '{param}.tool_call_id'.", param=f"{param}.tool_call_id", code="missing_required_parameter")
            items.append({"type": "function_call_output", "call_id": call_id, "output": _text_of(message.get("content"), f"{param}.content")})
        elif role == "function":
            raise invalid(f"'{param}.role' 'function' is deprecated and not supported; use 'tool' messages.", param=f"{param}.role")
        else:
            raise invalid(f"Invalid value for '{param}.role': {role!r}; expected one of system, developer, user, assistant, tool.", param=f"{param}.role")
    return items


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("Invalid type for 'tools': expected an array.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(f"Invalid value for '{param}.type': {kind!r}; only 'function' tools are supported.", param=f"{param}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"Missing required parameter: '{param}.function'.", param=f"{param}.function", code="missing_required_parameter")
        entry: dict[str, Any] = {"type": "function", "name": fn.get("name")}
        for key in ("description", "parameters"):
            if fn.get(key) is not None:
                entry[key] = fn[key]
        # OpenAI's Chat default is non-strict; Kiln keeps its Responses default (strict) unless the
        # client says ``strict: false``: a guarantee a client did not ask for breaks nothing, and a
        # small model given an open schema can add keys until it runs out of tokens.
        if fn.get("strict") is not None:
            entry["strict"] = parse_bool(fn["strict"], f"{param}.function.strict")
        out.append(entry)
    return out


def _fn_name(value: Any, param: str) -> str:
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid(f"Invalid '{param}': expected {{'type': 'function', 'function': {{'name': ...}}}}.", param=param)
    return str(fn["name"])


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # none / auto / required; validate_create refuses anything else
    if not isinstance(choice, dict):
        raise invalid("Invalid value for 'tool_choice'.", param="tool_choice")
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "name": _fn_name(choice, "tool_choice")}
    if kind == "allowed_tools":
        allowed = choice.get("allowed_tools")
        if not isinstance(allowed, dict) or not isinstance(allowed.get("tools"), list):
            raise invalid("Invalid 'tool_choice.allowed_tools': expected 'mode' and 'tools'.", param="tool_choice.allowed_tools")
        names = [_fn_name(t, f"tool_choice.allowed_tools.tools[{i}]") for i, t in enumerate(allowed["tools"])]
        return {"type": "allowed_tools", "mode": allowed.get("mode", "auto"), "tools": [{"type": "function", "name": n} for n in names]}
    raise invalid(f"Invalid value for 'tool_choice.type': {kind!r}.", param="tool_choice.type")


def _text_format(response_format: Any) -> dict[str, Any] | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise invalid("Invalid type for 'response_format': expected an object.", param="response_format")
    kind = response_format.get("type")
    if kind in ("text", "json_object"):
        return {"format": {"type": kind}}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("Missing required parameter: 'response_format.json_schema'.", param="response_format.json_schema", code="missing_required_parameter")
        fmt: dict[str, Any] = {"type": "json_schema", "name": spec.get("name"), "schema": spec.get("schema", {"type": "object"})}
        for key in ("description", "strict"):
            if spec.get(key) is not None:
                fmt[key] = spec[key]
        return {"format": fmt}
    raise invalid(f"Invalid value for 'response_format.type': {kind!r}; expected text, json_object or json_schema.", param="response_format.type")


def _max_tokens(raw: dict[str, Any]) -> Any:
    for key in ("max_completion_tokens", "max_tokens"):
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid(f"Invalid '{key}': expected an integer of at least 1.", param=key)
        return value
    return None


def _streaming(raw: dict[str, Any], body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` (also set on ``body``) and ``stream_options.include_usage``, as both chat-shaped
    doors read them."""
    stream = parse_bool(raw.get("stream"), "stream")
    body["stream"] = stream
    options = raw.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("Invalid type for 'stream_options': expected an object.", param="stream_options")
    return stream, bool(options and parse_bool(options.get("include_usage"), "stream_options.include_usage"))


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("Invalid type for 'stop': expected a string or an array of strings.", param="stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"Invalid 'stop': at most {MAX_STOP} stop sequences are allowed.", param="stop")
    return [s for s in stops if s]


def _logprobs(raw: dict[str, Any], body: dict[str, Any]) -> bool:
    want = parse_bool(raw.get("logprobs"), "logprobs")
    top = raw.get("top_logprobs")
    if top is not None and not want:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    if want:
        body["include"] = [LOGPROBS_INCLUDE]
        if top is not None:
            body["top_logprobs"] = top  # validate_create checks 0..20
    return want


def translate_chat(raw: dict[str, Any]) -> ChatRequest:
    """The Responses create body for a chat request (not yet validated) and the door's options."""
    n = raw.get("n")
    if n is not None and n != 1:
        raise invalid("Invalid 'n': this server generates one choice per request; 'n' must be 1.", param="n")
    if raw.get("audio") is not None:
        raise invalid("'audio' is not supported: this model produces text only.", param="audio")
    if raw.get("functions") is not None or raw.get("function_call") is not None:
        raise invalid("'functions' and 'function_call' are deprecated and not supported; use 'tools' and 'tool_choice'.", param="functions")
    body: dict[str, Any] = {k: raw[k] for k in PASSED if raw.get(k) is not None}
    body["input"] = messages_to_input(raw.get("messages"))
    body["store"] = False  # chat completions are not stored
    tools = _tools(raw.get("tools"))
    if tools is not None:
        body["tools"] = tools
    if raw.get("tool_choice") is not None:
        body["tool_choice"] = _tool_choice(raw["tool_choice"])
    text = _text_format(raw.get("response_format"))
    if text is not None:
        body["text"] = text
    max_out = _max_tokens(raw)
    if max_out is not None:
        body["max_output_tokens"] = max_out
    effort = raw.get("reasoning_effort")
    if effort is not None:
        body["reasoning"] = {"effort": effort}
    logprobs = _logprobs(raw, body)
    stream, include_usage = _streaming(raw, body)
    return ChatRequest(body=body, stream=stream, include_usage=include_usage, logprobs=logprobs, stop=_stop(raw.get("stop")))
