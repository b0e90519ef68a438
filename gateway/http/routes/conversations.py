"""``/v1/conversations``: OpenAI's Conversations API over the conversation store.

Thin adapters: the store (gateway/store/conversations.py) holds the conversations, keyed per
organization in hosted mode; responses created with ``conversation`` append to the same records.
Objects are OpenAI's ``ConversationResource``, ``ConversationItemList`` and
``DeletedConversationResource``.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...doors.serving import owner as _owner
from ...doors.serving import read_body
from ...doors.serving import service as _service
from ...doors.validation import check_metadata, normalize_input
from ...lifecycle.history import conversation_key
from ...lifecycle.service import ResponsesService
from ...store.conversations import Conversation, ConversationFull, as_resource_item, conversation_limit, conversation_size, new_conversation_id
from ...store.protocols import ConversationStore
from ..errors import ApiError, invalid
from .pagination import item_list, item_page

MAX_ITEMS_PER_CALL = 20  # OpenAI's limit on items added in one call


def _store(request: Request) -> ConversationStore:
    service = _service(request)
    if service.settings.store_mode == "none":
        raise ApiError(404, "Conversations are not stored on this gateway; send the whole conversation in 'input'.", code="not_found")
    if not service.stores.conversations.enabled:
        raise invalid("The conversation store is disabled on this server (--conversation-store-max-entries 0).")
    return service.stores.conversations


def _key(request: Request) -> str:
    return conversation_key(request.path_params["conversation_id"], _owner(request))


async def _require(request: Request, *, items: bool = True) -> Conversation:
    """The conversation (without its items unless asked: their cost grows with the conversation)."""
    store = _store(request)
    conv = await (store.get(_key(request)) if items else store.header(_key(request)))
    if conv is None:
        cid = request.path_params["conversation_id"]
        raise ApiError(404, f"Conversation with id '{cid}' not found.", code="not_found", param="conversation_id")
    return conv


async def _items(raw: Any, param: str, service: ResponsesService, owner: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid(f"Invalid type for '{param}': expected an array of items.", param=param)
    if len(raw) > MAX_ITEMS_PER_CALL:
        raise invalid(f"Invalid '{param}': at most {MAX_ITEMS_PER_CALL} items may be added at a time.", param=param)
    try:
        items = normalize_input(raw)
    except ApiError as error:  # the checks name input[i]; here the field is ``param``
        error.message = error.message.replace("'input", f"'{param}")
        error.param = (error.param or "").replace("input", param, 1) or param
        raise
    if any(i.get("type") in ("compaction_trigger",) for i in items):
        raise invalid(f"Invalid '{param}': a compaction_trigger is a request, not a conversation item.", param=param)
    return service.references.unseal(await service.references.resolve(items, owner))


async def _index(request: Request, key: str, items: list[dict[str, Any]]) -> None:
    await _service(request).references.index(_owner(request), items, ("conversation", key))


async def create_conversation(request: Request) -> Response:
    raw = await read_body(request)
    store = _store(request)
    metadata = check_metadata(raw.get("metadata")) or {}
    items = await _items(raw.get("items"), "items", _service(request), _owner(request))
    conv = Conversation(new_conversation_id(), int(time.time()), metadata, [as_resource_item(i) for i in items])
    key = conversation_key(conv.id, _owner(request))
    if not await store.create(key, conv):  # with its items, in one write
        # Over the organization's share (hosted) or the store's budget: the limit an append meets.
        limit, owned = conversation_limit(key, store.max_bytes)
        raise ConversationFull(conversation_size(conv), limit, owned=owned)
    await _index(request, key, conv.items)
    return JSONResponse(conv.resource())


async def get_conversation(request: Request) -> Response:
    return JSONResponse((await _require(request, items=False)).resource())


async def update_conversation(request: Request) -> Response:
    raw = await read_body(request)
    await _require(request, items=False)
    if "metadata" not in raw:
        raise invalid("Missing required parameter: 'metadata'.", param="metadata", code="missing_required_parameter")
    metadata = check_metadata(raw.get("metadata")) or {}
    conv = await _store(request).set_metadata(_key(request), metadata)
    if conv is None:  # deleted meanwhile (by another request)
        conv = await _require(request, items=False)
    return JSONResponse(conv.resource())


async def delete_conversation(request: Request) -> Response:
    conv = await _require(request, items=False)
    await _store(request).delete(_key(request))
    return JSONResponse({"id": conv.id, "object": "conversation.deleted", "deleted": True})


def _page(items: list[dict[str, Any]], request: Request) -> dict[str, Any]:
    for value in request.query_params.getlist("include"):
        if value not in ("message.output_text.logprobs", "reasoning.encrypted_content"):
            raise invalid(f"Invalid value for 'include': {value!r} is not supported here.", param="include")
    return item_page(items, request.query_params, unknown_after="no item '{id}' in this conversation")


async def list_items(request: Request) -> Response:
    return JSONResponse(_page((await _require(request)).items, request))


async def add_items(request: Request) -> Response:
    raw = await read_body(request)
    await _require(request, items=False)
    if "items" not in raw:
        raise invalid("Missing required parameter: 'items'.", param="items", code="missing_required_parameter")
    items = await _items(raw.get("items"), "items", _service(request), _owner(request))
    conv = await _require(request, items=False)
    added = await _store(request).add_items(_key(request), items, conversation_id=conv.id)
    await _index(request, _key(request), added)
    return JSONResponse(item_list(added))


def _require_item(request: Request, conv: Conversation) -> dict[str, Any]:
    item_id = request.path_params["item_id"]
    item = conv.find(item_id)
    if item is None:
        raise ApiError(404, f"Item with id '{item_id}' not found in conversation '{conv.id}'.", code="not_found", param="item_id")
    return item


async def get_item(request: Request) -> Response:
    conv = await _require(request)
    return JSONResponse(_require_item(request, conv))


async def delete_item(request: Request) -> Response:
    conv = await _require(request)
    _require_item(request, conv)
    after = await _store(request).delete_item(_key(request), request.path_params["item_id"])
    if after is None:  # removed meanwhile (by another request)
        _require_item(request, await _require(request))
        after = conv
    return JSONResponse(after.resource())


ROUTES: list[tuple[str, Any, list[str]]] = [
    ("/conversations", create_conversation, ["POST"]),
    ("/conversations/{conversation_id}", get_conversation, ["GET"]),
    ("/conversations/{conversation_id}", update_conversation, ["POST"]),
    ("/conversations/{conversation_id}", delete_conversation, ["DELETE"]),
    ("/conversations/{conversation_id}/items", list_items, ["GET"]),
    ("/conversations/{conversation_id}/items", add_items, ["POST"]),
    ("/conversations/{conversation_id}/items/{item_id}", get_item, ["GET"]),
    ("/conversations/{conversation_id}/items/{item_id}", delete_item, ["DELETE"]),
]
