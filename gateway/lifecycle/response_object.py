"""The Response object of one request, built up from the worker's events."""

from __future__ import annotations

import time
import uuid
from typing import Any

from kiln.protocol.events import WorkerEvent, is_item_done
from kiln.protocol.usage import Usage

from ..doors.create_request import CreateRequest

# Fields echoed from the request into every Response object, with their defaults.
_ECHOED: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "instructions": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "metadata": None,
    "parallel_tool_calls": True,
    "presence_penalty": 0.0,
    "previous_response_id": None,
    "prompt_cache_key": None,
    "reasoning": None,
    "safety_identifier": None,
    "temperature": 1.0,
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": 0,
    "top_p": 1.0,
    "truncation": "disabled",
}


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A declared tool as the Response object lists it: function tools always carry ``strict``
    (the Responses API's default is true) and ``parameters``."""
    if tool.get("type") == "function":
        return {**tool, "strict": tool.get("strict", True), "parameters": tool.get("parameters")}
    if tool.get("type") == "namespace":
        return {**tool, "tools": [_echo_tool({**t, "type": t.get("type", "function")}) for t in tool.get("tools") or []]}
    return tool


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def zero_usage() -> dict[str, Any]:
    return Usage().to_map()


class ResponseObject:
    """Holds the evolving Response for one create call.

    Output items are taken from ``response.output_item.done`` events, so the final object carries
    exactly the items a streaming client saw completed, with the same ids and order.
    """

    def __init__(self, response_id: str, request: CreateRequest, model: str, *, echo_background: bool = False) -> None:
        """``echo_background`` (--echo-background): a foreground response says
        ``"background": false`` too, for clients that hold every Response to OpenAI's schema,
        which requires the key; by default it has no such key, as the spec says."""
        self.data: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": request.background,
            "error": None,
            "incomplete_details": None,
            "model": model,
            "output": [],
            # Present (null) until the response ends: stricter schemas require the keys on every
            # snapshot, including response.created / response.in_progress.
            "usage": None,
            "completed_at": None,
            # One tier is served; whatever a client asked for, this is what ran.
            "service_tier": "default",
            "store": request.store,
            "text": request.text or {"format": {"type": "text"}},
        }
        for key, default in _ECHOED.items():
            value = getattr(request, key)
            self.data[key] = default if value is None else value
        self.data["tools"] = [_echo_tool(t) for t in self.data["tools"]]
        conv = request.conversation
        if conv is not None:
            self.data["conversation"] = {"id": conv} if isinstance(conv, str) else {"id": conv.get("id")}
        if not self.data["background"] and not echo_background:
            del self.data["background"]
        self._items: dict[int, dict[str, Any]] = {}

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def status(self) -> str:
        return str(self.data["status"])

    def snapshot(self) -> dict[str, Any]:
        """A copy safe to serialize while generation goes on."""
        snap = dict(self.data)
        snap["output"] = list(self.data["output"])
        return snap

    def apply(self, event: WorkerEvent) -> None:
        if is_item_done(event):
            self._items[event["output_index"]] = event["item"]
            self.data["output"] = [self._items[i] for i in sorted(self._items)]

    def finish(self, status: str, usage: dict[str, Any], incomplete: dict[str, Any] | None = None) -> None:
        self.data["status"] = status
        self.data["usage"] = usage
        self.data["incomplete_details"] = incomplete
        self.data["completed_at"] = int(time.time()) if status == "completed" else None

    def fail(self, code: str, message: str) -> None:
        self.data["status"] = "failed"
        self.data["error"] = {"code": code, "message": message}
        if self.data.get("usage") is None:
            self.data["usage"] = zero_usage()

    def cancel(self) -> None:
        self.data["status"] = "cancelled"
        if self.data.get("usage") is None:
            self.data["usage"] = zero_usage()
