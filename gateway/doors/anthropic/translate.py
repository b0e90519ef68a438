"""Anthropic Messages API as a front door onto the Responses engine.

Two halves, both free of HTTP so they can be tested alone:

- ``to_responses_body`` turns a Messages create (or count_tokens) body into a Responses create
  body that ``validation.validate_create`` accepts, so every later step -- admission, routing,
  caches, the tool grammar, metering -- is the one ``/v1/responses`` uses.
- ``MessageTranslator`` turns the Responses stream events of that generation into Anthropic's
  stream events (``message_start`` ... ``message_stop``) and, from the same state, the final
  Message object, so a streamed and a non-streamed answer can never disagree.

Stop sequences are applied here, on the text as it streams, because the worker has no stop
strings of its own (``doors/stop.py``'s cutter, the Chat door's too): text up to the match is
delivered, the rest withheld, and the door stops the generation.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.protocol.events import is_arguments_delta, is_item_added, is_item_done, is_reasoning_delta, is_text_delta

from ...http.errors import invalid
from ...lifecycle.generation import RunEvent
from ..stop import StopCutter

# Anthropic's error ``type`` for each HTTP status Kiln answers with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
MAX_STOP_SEQUENCES = 16  # plenty for real clients; each one costs a scan of every delta
MESSAGES_PATHS = ("/v1/messages", "/messages")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape, which its SDKs read the message from."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def is_messages_path(path: str) -> bool:
    """Whether errors on ``path`` must be in Anthropic's shape (used by the hosted middleware,
    which refuses before any route runs)."""
    return any(path == p or path.startswith(p + "/") for p in MESSAGES_PATHS)


# -- request --------------------------------------------------------------------------------------
def _require(raw: Mapping[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise invalid(f"{key}: Field required", param=key, code="missing_required_parameter")
    return raw[key]


def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or of a list of text blocks (system prompts, tool results)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise invalid(f"{where}: expected a string or a list of text blocks.", param=where)
    texts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in ("image", "document", "search_result"):
                raise invalid(f"{where}.{i}: '{kind}' blocks are not supported: this model takes text only.", param=f"{where}.{i}")
            raise invalid(f"{where}.{i}: expected a text block.", param=f"{where}.{i}")
        texts.append(block["text"])
    return "\n".join(texts)


def _thinking_item(block: dict[str, Any]) -> dict[str, Any]:
    """A thinking block handed back: reasoning, with the signature as the sealed content (Kiln's
    own signature restores the text the model wrote; another server's is dropped by the service)."""
    item: dict[str, Any] = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": str(block.get("thinking") or "")}]}
    if isinstance(block.get("signature"), str) and block["signature"]:
        item["encrypted_content"] = block["signature"]
    return item


def _message_items(index: int, message: Any) -> list[dict[str, Any]]:
    """One Messages turn as Responses input items, in block order."""
    where = f"messages.{index}"
    if not isinstance(message, dict):
        raise invalid(f"{where}: expected an object.", param=where)
    role = message.get("role")
    if role == "system" and index > 0:
        # A mid-conversation system message (Claude Code sends one with the beta
        # mid-conversation-tool-changes): instructions that apply from this point on, rendered as
        # a system turn at its place so the turns before it keep their cached prefix.
        return [{"type": "message", "role": "system", "content": _text_of(message.get("content"), f"{where}.content")}]
    if role not in ("user", "assistant"):
        hint = " A system message cannot be the first; the top-level 'system' is for that." if role == "system" else ""
        raise invalid(f"{where}.role: Input should be 'user', 'assistant' or 'system'.{hint}", param=f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "message", "role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content: expected a string or a list of content blocks.", param=f"{where}.content")
    items: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    part_type = "output_text" if role == "assistant" else "input_text"

    def flush() -> None:
        if parts:
            items.append({"type": "message", "role": role, "content": list(parts)})
            parts.clear()

    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        if not isinstance(block, dict):
            raise invalid(f"{at}: expected a content block object.", param=at)
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid(f"{at}.text: expected a string.", param=f"{at}.text")
            parts.append({"type": part_type, "text": block["text"]})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid(f"{at}: a tool_use block needs 'id' and 'name'.", param=at)
            flush()
            items.append({"type": "function_call", "call_id": block["id"], "name": block["name"], "arguments": json.dumps(block.get("input") or {})})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(f"{at}.tool_use_id: Field required", param=f"{at}.tool_use_id")
            flush()
            output = _text_of(block.get("content") or "", f"{at}.content")
            if block.get("is_error"):
                output = f"Error: {output}"
            items.append({"type": "function_call_output", "call_id": block["tool_use_id"], "output": output})
        elif kind == "thinking" and role == "assistant":
            flush()
            items.append(_thinking_item(block))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # another server's opaque reasoning: nothing this model can read
        elif kind in ("image", "document", "search_result"):
            raise invalid(f"{at}: '{kind}' blocks are not supported: this model takes text only.", param=f"{at}.type")
        else:
            raise invalid(f"{at}.type: {kind!r} is not a supported content block in a {role} message.", param=f"{at}.type")
    flush()
    return items


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("tools: expected a list.", param="tools")
    out = []
    for i, tool in enumerate(raw):
        at = f"tools.{i}"
        if not isinstance(tool, dict):
            raise invalid(f"{at}: expected an object.", param=at)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise invalid(f"{at}.type: server tool {kind!r} is not supported: this server runs client tools (name + input_schema) only.", param=f"{at}.type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise invalid(f"{at}.name: Field required", param=f"{at}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"{at}.input_schema: Field required (a JSON Schema object).", param=f"{at}.input_schema")
        fn: dict[str, Any] = {"type": "function", "name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        if isinstance(tool.get("strict"), bool):
            fn["strict"] = tool["strict"]
        out.append(fn)
    return out


def _tool_choice(raw: Any) -> tuple[Any, bool | None]:
    """(Responses tool_choice, parallel_tool_calls) for a Messages tool_choice."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        raise invalid("tool_choice: expected an object such as {\"type\": \"auto\"}.", param="tool_choice")
    kind = raw.get("type")
    parallel = None if raw.get("disable_parallel_tool_use") is None else not bool(raw["disable_parallel_tool_use"])
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(raw.get("name"), str):
            raise invalid("tool_choice.name: Field required", param="tool_choice.name")
        return {"type": "function", "name": raw["name"]}, parallel
    raise invalid(f"tool_choice.type: {kind!r}; expected 'auto', 'any', 'tool' or 'none'.", param="tool_choice.type")


def _number(raw: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise invalid(f"{key}: expected a number from {low:g} to {high:g}.", param=key)
    return value


def _stop_sequences(raw: Any) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(s, str) and s for s in raw):
        raise invalid("stop_sequences: expected a list of non-empty strings.", param="stop_sequences")
    if len(raw) > MAX_STOP_SEQUENCES:
        raise invalid(f"stop_sequences: at most {MAX_STOP_SEQUENCES} are allowed.", param="stop_sequences")
    return list(raw)


def _thinking_shown(raw: Any) -> bool:
    """Whether thinking blocks are returned. Only a reasoning model produces them; an explicit
    ``{"type": "disabled"}`` hides them (the model still reasons if its template makes it)."""
    if raw is None:
        return True
    if not isinstance(raw, dict) or raw.get("type") not in ("enabled", "disabled", "adaptive"):
        raise invalid("thinking.type: expected 'enabled', 'disabled' or 'adaptive'.", param="thinking.type")
    if raw["type"] == "enabled":
        budget = raw.get("budget_tokens")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise invalid("thinking.budget_tokens: expected a positive integer.", param="thinking.budget_tokens")
    return bool(raw["type"] != "disabled")


@dataclass
class MessagesRequest:
    """A translated Messages request: the Responses body plus what only this door applies."""

    body: dict[str, Any]
    model: str
    stream: bool = False
    stop_sequences: list[str] = field(default_factory=list)
    show_thinking: bool = True


def to_responses_body(raw: Any, *, count_only: bool = False) -> MessagesRequest:
    """Translate a Messages body; raise ApiError(400) naming the field for the first fault.

    ``count_only`` (count_tokens) does not require ``max_tokens``, as Anthropic's does not.
    ``top_k`` is accepted and not applied: the worker's sampler has temperature and top_p only.
    Unknown top-level fields are ignored, as clients send beta fields freely."""
    if not isinstance(raw, dict):
        raise invalid("The request body must be a JSON object.")
    model = _require(raw, "model")
    if not isinstance(model, str):
        raise invalid("model: expected a string.", param="model")
    messages = _require(raw, "messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: expected a non-empty list of messages.", param="messages")
    body: dict[str, Any] = {"model": model, "store": False}
    if not count_only:
        max_tokens = _require(raw, "max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise invalid("max_tokens: expected an integer of at least 1.", param="max_tokens")
        body["max_output_tokens"] = max_tokens
    if raw.get("system") is not None:
        body["instructions"] = _text_of(raw["system"], "system")
    body["input"] = [item for i, m in enumerate(messages) for item in _message_items(i, m)]
    tools = _tools(raw.get("tools"))
    choice, parallel = _tool_choice(raw.get("tool_choice"))
    if tools:
        body["tools"] = tools
    if choice is not None:
        if choice == "none" and not tools:
            choice = None
        elif choice != "auto" and not tools:
            raise invalid("tool_choice: a tool must be declared in 'tools' to force tool use.", param="tool_choice")
        if choice is not None:
            body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    for key in ("temperature", "top_p"):
        value = _number(raw, key, 0, 1)
        if value is not None:
            body[key] = value
    top_k = raw.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise invalid("top_k: expected a non-negative integer.", param="top_k")
    stream = raw.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream: expected a boolean.", param="stream")
    metadata = raw.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata: expected an object.", param="metadata")
    body["stream"] = stream and not count_only
    return MessagesRequest(
        body=body,
        model=model,
        stream=body["stream"],
        stop_sequences=_stop_sequences(raw.get("stop_sequences")),
        show_thinking=_thinking_shown(raw.get("thinking")),
    )


# -- response -------------------------------------------------------------------------------------
def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def anthropic_usage(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """Responses usage in Anthropic's terms: ``input_tokens`` excludes the prompt tokens read from
    the prefix cache, which are ``cache_read_input_tokens``; their sum is the prompt's length (what
    count_tokens answers)."""
    usage = usage or {}
    total = int(usage.get("input_tokens") or 0)
    cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": total - cached,
        "output_tokens": int(usage.get("output_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


@dataclass
class _Block:
    index: int
    kind: str  # "text" | "thinking" | "tool_use"
    source: int  # the Responses output_index it comes from
    data: dict[str, Any]
    parts: list[str] = field(default_factory=list)
    open: bool = True
    cut: bool = False  # a tool_use whose call the output ended inside (its item is incomplete)


class MessageTranslator:
    """Responses stream events in, Anthropic stream events out; one instance per message.

    Anthropic streams one content block at a time, so a block is closed as soon as another output
    item produces content (and reopened as a new block should its item speak again)."""

    def __init__(self, model: str, *, stop_sequences: list[str] | None = None, show_thinking: bool = True, seal: Callable[[str], str] | None = None) -> None:
        self.id = new_message_id()
        self.model = model
        self.show_thinking = show_thinking
        self.stopper = StopCutter(stop_sequences or [])
        self._seal = seal or (lambda text: "")
        self.blocks: list[_Block] = []
        self._current: _Block | None = None
        self._calls: set[int] = set()

    @property
    def stopped(self) -> bool:
        """A stop sequence was found: the door stops the generation."""
        return self.stopper.matched is not None

    def start_events(self, usage: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """``message_start`` (with the prompt's usage when the worker has reported it) and a ping."""
        message = {**self._shell(), "usage": {**anthropic_usage(usage), "output_tokens": 0}}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _shell(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None}

    # -- blocks -----------------------------------------------------------------------------------
    def _close(self) -> list[dict[str, Any]]:
        block, self._current = self._current, None
        if block is None or not block.open:
            return []
        block.open = False
        events = []
        if block.kind == "thinking":
            block.data["signature"] = self._seal("".join(block.parts))
            events.append({"type": "content_block_delta", "index": block.index, "delta": {"type": "signature_delta", "signature": block.data["signature"]}})
        events.append({"type": "content_block_stop", "index": block.index})
        return events

    def _open(self, kind: str, source: int, data: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        block = _Block(len(self.blocks), kind, source, data)
        self.blocks.append(block)
        self._current = block
        start = {**data, "input": {}} if kind == "tool_use" else dict(data)
        events.append({"type": "content_block_start", "index": block.index, "content_block": start})
        return events

    def _delta(self, kind: str, source: int, piece: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not piece:
            return events
        block = self._current
        if block is None or block.kind != kind or block.source != source:
            empty = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}[kind]
            events += self._open(kind, source, empty)
            block = self._current
        assert block is not None
        block.parts.append(piece)
        delta = {"type": "text_delta", "text": piece} if kind == "text" else {"type": "thinking_delta", "thinking": piece}
        events.append({"type": "content_block_delta", "index": block.index, "delta": delta})
        return events

    def _text(self, source: int, piece: str) -> list[dict[str, Any]]:
        return self._delta("text", source, self.stopper.feed(piece))

    def _release_held(self) -> list[dict[str, Any]]:
        """Text held back as a possible stop-sequence start, once no more text can follow it."""
        held = self.stopper.flush()
        if not held:
            return []
        block = self._current
        source = block.source if block is not None and block.kind == "text" else -1
        return self._delta("text", source, held)

    # -- events -----------------------------------------------------------------------------------
    def feed(self, event: RunEvent) -> list[dict[str, Any]]:
        """The Anthropic events for one Responses event (often none)."""
        if self.stopped:
            return []
        if is_text_delta(event):
            return self._text(event.get("output_index", -1), event.get("delta") or "")
        if is_reasoning_delta(event) and self.show_thinking:
            return self._delta("thinking", event.get("output_index", -1), event.get("delta") or "")
        if is_item_added(event) and (event.get("item") or {}).get("type") == "function_call":
            item, index = event["item"], event.get("output_index", -1)
            self._calls.add(index)
            events = self._release_held()
            return events + self._open("tool_use", index, {"type": "tool_use", "id": item.get("call_id"), "name": item.get("name")})
        if is_arguments_delta(event) and (index := event.get("output_index", -1)) in self._calls:
            block = self._current
            if block is None or block.source != index:
                return []  # its block was closed by another item's content; the done event fixes it
            block.parts.append(event.get("delta") or "")
            return [{"type": "content_block_delta", "index": block.index, "delta": {"type": "input_json_delta", "partial_json": event.get("delta") or ""}}]
        if is_item_done(event):
            item, index = event.get("item") or {}, event.get("output_index", -1)
            if item.get("type") == "function_call":
                for block in self.blocks:
                    if block.kind == "tool_use" and block.source == index:
                        block.data["input"] = _arguments(item.get("arguments"), "".join(block.parts))
                        block.cut = item.get("status") == "incomplete"
            if item.get("type") == "message":
                events = self._release_held()
                if self._current is not None and self._current.source in (index, -1):
                    events += self._close()
                return events
            if self._current is not None and self._current.source == index:
                return self._close()
        return []

    def end_events(self, status: str, usage: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        """Close what is open and tell the outcome: ``message_delta`` (stop reason, usage) and
        ``message_stop``."""
        events = self._release_held() + self._close()
        stop_reason, stop_sequence = self.stop_reason(status)
        return events + [
            {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": anthropic_usage(usage)},
            {"type": "message_stop"},
        ]

    def stop_reason(self, status: str) -> tuple[str, str | None]:
        if self.stopper.matched is not None:
            return "stop_sequence", self.stopper.matched
        calls = [b for b in self.blocks if b.kind == "tool_use"]
        if calls and not any(b.cut for b in calls):
            return "tool_use", None
        if status == "incomplete":  # a call cut off by max_tokens is not one to run
            return "max_tokens", None
        return "end_turn", None

    def message(self, status: str, usage: Mapping[str, Any] | None) -> dict[str, Any]:
        """The final Message object (call after the events are drained and ``end_events``)."""
        self._release_held()
        self._close()
        content = []
        for block in self.blocks:
            if block.kind == "text":
                content.append({"type": "text", "text": "".join(block.parts)})
            elif block.kind == "thinking":
                content.append({"type": "thinking", "thinking": "".join(block.parts), "signature": block.data.get("signature", "")})
            else:
                data = block.data
                content.append({"type": "tool_use", "id": data["id"], "name": data["name"], "input": data.get("input", _arguments(None, "".join(block.parts)))})
        stop_reason, stop_sequence = self.stop_reason(status)
        return {**self._shell(), "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": anthropic_usage(usage)}


def _arguments(final: Any, streamed: str) -> dict[str, Any]:
    """A call's input object: the worker's final arguments, else what streamed; a tool_use input
    is always an object."""
    for text in (final, streamed):
        if isinstance(text, str) and text.strip():
            try:
                value = json.loads(text)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return {}
