"""What a create's input refers to, made concrete before it renders: ``item_reference`` items
replaced by the stored items they name, reasoning sealed in ``encrypted_content`` opened again,
every own item given an id. Shared by create, the token counter, ``/v1/responses/compact`` and
the Conversations API's item appends, so that an input means the same thing on each of them."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from ..http.errors import invalid
from ..store.conversations import as_input_item
from ..store.protocols import StoreUnavailable
from ..store.stores import Stores
from .sealing import SealError, Sealer

log = logging.getLogger("kiln.gateway.responses")

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs", "compaction": "cmp"}


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as the input_items endpoint lists them: each with an id, message content as
    a list of parts."""
    out = []
    for item in items:
        if item.get("type") == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item = {**item, "content": [{"type": part, "text": item["content"]}]}
        if not item.get("id"):
            item = {**item, "id": f"{_ID_PREFIX.get(str(item.get('type')), 'item')}_{uuid.uuid4().hex}"}
        out.append(item)
    return out


class References:
    """Item references and sealed reasoning, against one gateway's stores and key."""

    def __init__(self, stores: Stores, sealer: Sealer) -> None:
        self.stores = stores
        self.sealer = sealer

    async def own_input(self, items: list[dict[str, Any]], owner: Any) -> list[dict[str, Any]]:
        """A request's own items, concrete: references resolved, reasoning unsealed, ids given."""
        return with_ids(self.unseal(await self.resolve(items, owner)))

    async def resolve(self, items: list[dict[str, Any]], owner: Any = None) -> list[dict[str, Any]]:
        """``item_reference`` items replaced by the items they name: input or output items of the
        owner's stored responses, or items of the owner's conversations. An id that names
        nothing the owner may see is a 400 naming it (never silently dropped)."""
        if not any(i.get("type") == "item_reference" for i in items):
            return items
        out = []
        for i, item in enumerate(items):
            if item.get("type") != "item_reference":
                out.append(item)
                continue
            item_id = item.get("id")
            if not isinstance(item_id, str) or not item_id:
                raise invalid(f"Missing or invalid 'input[{i}].id': an item_reference names a stored item by id.", param=f"input[{i}].id")
            found = await self._find(item_id, owner)
            if found is None:
                raise invalid(f"Item with id '{item_id}' not found.", param=f"input[{i}].id", code="item_not_found")
            out.append(as_input_item(found))
        return out

    async def _find(self, item_id: str, owner: Any) -> dict[str, Any] | None:
        where = await self.stores.items.lookup(owner, item_id)
        if where is None:
            return None
        kind, key = where
        if kind == "response":
            store = self.stores.responses
            stored = await store.get(key) if store is not None else None
            if stored is None or stored.ephemeral or stored.extra.get("owner") != owner:
                return None
            pool = list(stored.input_items) + list(stored.response.get("output") or [])
        else:
            conv = await self.stores.conversations.get(key)
            if conv is None:
                return None
            pool = conv.items
        return next((dict(i) for i in pool if i.get("id") == item_id), None)

    async def index(self, owner: Any, items: list[dict[str, Any]], holder: tuple[str, str]) -> None:
        """Index stored items for ``item_reference``; best effort (the holder is stored already,
        an item left out is only unreferenceable by id)."""
        try:
            await self.stores.items.add(owner, items, holder)
        except StoreUnavailable:
            log.warning("stored items not indexed: the store is unavailable", extra={"holder": holder[0]})

    def seal_text(self, text: str) -> str:
        """Reasoning text as the ``encrypted_content`` a client carries back."""
        return self.sealer.seal("reasoning", {"text": text})

    def seal_reasoning(self, item: dict[str, Any]) -> dict[str, Any]:
        if item.get("type") != "reasoning":
            return item
        return {**item, "encrypted_content": self.seal_text("".join(c.get("text", "") for c in item.get("content") or []))}

    def unseal(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Reasoning carried back in ``encrypted_content`` becomes renderable content again.

        A blob in Kiln's format that fails verification is refused; another server's blob (a
        client that switched providers) cannot be read, so it is dropped.
        """
        out = []
        for i, item in enumerate(items):
            blob = item.get("encrypted_content")
            if item.get("type") == "reasoning" and blob:
                if not self.sealer.is_ours(blob):
                    item = {k: v for k, v in item.items() if k != "encrypted_content"}
                else:
                    try:
                        payload = self.sealer.unseal("reasoning", blob)
                    except SealError as exc:
                        raise invalid(f"'input[{i}].encrypted_content' was not produced by this server or was altered ({exc}).", param=f"input[{i}].encrypted_content")
                    item = {**item, "content": [{"type": "reasoning_text", "text": payload.get("text", "")}]}
            out.append(item)
        return out
