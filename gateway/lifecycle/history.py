"""Turning ``previous_response_id`` and ``conversation`` into the history a request renders."""

from __future__ import annotations

from typing import Any

from ..doors.create_request import CreateRequest
from ..http.errors import ApiError, invalid
from ..store.protocols import ConversationStore, JobBoard, ResponseStore

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


def conversation_id(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    cid = value.get("id")
    if not isinstance(cid, str):
        raise invalid("Invalid 'conversation': expected an id string or {\"id\": ...}.", param="conversation")
    return cid


async def previous_history(previous_id: str, store: ResponseStore, jobs: JobBoard, owner: Any = None) -> list[dict[str, Any]]:
    """The stored response's input and output, as items to render before the new input.

    Instructions are not carried: each request states its own.
    """
    stored = await store.get(previous_id)
    if stored is None:
        job = await jobs.get(previous_id)  # a job's final object is stored when it ends
        if job is not None and job.owner == owner:
            raise invalid(f"previous response '{previous_id}' has not finished (status: {job.view.get('status')})", param="previous_response_id")
    if stored is None or not stored.chainable or stored.owner != owner:
        raise invalid(f"Previous response with id '{previous_id}' not found.", param="previous_response_id", code="previous_response_not_found")
    status = stored.response.get("status")
    if status not in TERMINAL:
        raise invalid(f"previous response '{previous_id}' has not finished (status: {status})", param="previous_response_id")
    # A compaction item in the output is already part of the stored input (auto-compaction
    # rewrote the input before generating), so it is not replayed twice.
    output = [item for item in stored.response.get("output") or [] if item.get("type") != "compaction"]
    return list(stored.input_items) + [_as_input(item) for item in output]


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item replayed as input (drop fields only outputs carry)."""
    return {k: v for k, v in item.items() if k not in ("status",)} if item.get("type") != "message" else {
        "type": "message",
        "role": item.get("role", "assistant"),
        "content": item.get("content") or [],
        "id": item.get("id"),
    }


def conversation_key(conv: str, owner: Any) -> str:
    """Transcripts are per owner (organization) so that ids cannot collide across tenants."""
    return conv if owner is None else f"{owner}:{conv}"


def _not_stored(param: str, what: str) -> ApiError:
    return ApiError(400, f"'{param}' is not supported: {what} are not stored on this gateway. Send the full conversation in 'input'.", code="unsupported_parameter", param=param)


async def expand(request: CreateRequest, *, store: ResponseStore | None, jobs: JobBoard, conversations: ConversationStore, store_mode: str, owner: Any = None) -> list[dict[str, Any]]:
    """History items for ``request`` (not including its own input)."""
    previous = request.previous_response_id
    conv = conversation_id(request.conversation)
    if previous is not None and conv is not None:
        raise invalid("'previous_response_id' and 'conversation' cannot be used together.", param="previous_response_id")
    if previous is not None:
        if store_mode == "none":
            raise _not_stored("previous_response_id", "responses")
        if store is None or not store.enabled:
            raise invalid("'previous_response_id' needs the response store, which is disabled on this server.", param="previous_response_id")
        return await previous_history(previous, store, jobs, owner)
    if conv is not None:
        if store_mode == "none":
            # The store-less contract keeps nothing, transcripts included (a transcript kept here
            # would hold a tenant's prompts past its request and be a target for the others).
            raise _not_stored("conversation", "conversations")
        if not conversations.enabled:
            raise invalid("'conversation' needs the conversation store, which is disabled on this server.", param="conversation")
        key = conversation_key(conv, owner)
        if await conversations.get(key) is None:  # as OpenAI: a create never starts one
            raise ApiError(404, f"Conversation with id '{conv}' not found.", code="not_found", param="conversation")
        return await conversations.transcript(key)
    return []


def check_call_outputs(items: list[dict[str, Any]]) -> None:
    """Every ``function_call_output`` answers a call made earlier in the history (as OpenAI
    checks): an output for no call is a 400, on HTTP and WebSocket alike, rather than a turn the
    model cannot make sense of."""
    calls: set[Any] = set()
    for item in items:
        kind = item.get("type")
        if kind == "function_call":
            calls.add(item.get("call_id"))
        elif kind == "function_call_output" and item.get("call_id") not in calls:
            raise invalid(f"No tool call found for function call output with call_id {item.get('call_id')}.", param="input")

