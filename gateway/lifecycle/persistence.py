"""What a finished response leaves behind: its reasoning for the echo, its turn in its
conversation, the stored object (for a job, stored as the job ends, in one step) and the index
that lets its items be referenced by id."""

from __future__ import annotations

from typing import Any

from ..doors.create_request import CreateRequest
from ..store.conversations import ConversationFull
from ..store.lru import OWNER_SHARE
from ..store.protocols import Job, StoreUnavailable
from ..store.responses import StoredResponse
from ..store.stores import Stores
from .history import conversation_id, conversation_key
from .references import References
from .response_object import ResponseObject, zero_usage


class Persistence:
    def __init__(self, stores: Stores, references: References) -> None:
        self.stores = stores
        self.references = references

    def keeps(self, request: CreateRequest) -> bool:
        """Whether a foreground response to ``request`` is stored."""
        store = self.stores.responses
        return store is not None and store.enabled and request.store

    async def persist(self, response: ResponseObject, request: CreateRequest, own_input: list[dict[str, Any]], *, job: Job | None = None, owner: Any = None) -> None:
        """Remember the reasoning, append the turn to its conversation, store the response (for a
        job: store its final object and end the job, in one step).

        Raises StoreUnavailable when the store is down, ConversationFull when the conversation
        cannot take the turn; a job is ended anyway (failed, if its conversation could not take
        the turn), so it is never left running."""
        background = job is not None
        snapshot = response.snapshot()
        if snapshot.get("usage") is None:
            snapshot["usage"] = zero_usage()
        await self.stores.reasoning_echo.remember(snapshot["output"], owner)
        if response.status in ("completed", "incomplete") and snapshot["output"]:
            try:
                await self._append_turn(request, own_input, snapshot["output"], owner)
            except StoreUnavailable:
                if not background:
                    raise
                response.fail("server_error", "The response could not be appended to its conversation: the conversation store is unavailable.")
                snapshot = dict(response.snapshot(), output=[])
            except ConversationFull as full:
                full.param = "conversation"
                response.fail("server_error", f"The response could not be appended to its conversation: {full.message}")
                if not background:
                    raise
                snapshot = dict(response.snapshot(), output=[])
        store = self.stores.responses
        if store is None:
            return
        ephemeral = background and not request.store
        if not request.store and not ephemeral:
            return
        stored = StoredResponse(snapshot, request.input, ephemeral=ephemeral, extra={"owner": owner})
        # An organization may fill its share of the store (store/lru.py), local mode all of it.
        budget, whose = (store.max_bytes, "the response store's byte budget") if owner is None else (int(OWNER_SHARE * store.max_bytes), "this organization's share of the response store")
        if background and store.size_of(stored) > budget:
            # Too large for the budget: keep a failed stub so that a poll still gets an answer.
            stub = dict(snapshot, status="failed", output=[], usage=zero_usage(), error={"code": "server_error", "message": f"The finished response is larger than {whose} ({budget} bytes)."})
            stored = StoredResponse(stub, [], ephemeral=ephemeral, extra={"owner": owner})
        kept = await self.stores.jobs.finish(job, stored) if job is not None else await store.put(stored)
        if kept and not ephemeral and stored.response is snapshot:
            await self.references.index(owner, list(stored.input_items) + list(snapshot["output"]), ("response", snapshot["id"]))

    async def _append_turn(self, request: CreateRequest, own_input: list[dict[str, Any]], output: list[dict[str, Any]], owner: Any) -> None:
        conv = conversation_id(request.conversation)
        if conv is None:
            return
        key = conversation_key(conv, owner)
        output = [{k: v for k, v in i.items() if k != "status"} for i in output]
        if output and output[0].get("type") == "compaction":
            # Auto-compaction rewrote the history: the transcript becomes the compacted one.
            added = await self.stores.conversations.replace(key, request.input + output[1:], conversation_id=conv)
        else:
            added = await self.stores.conversations.add_items(key, own_input + output, conversation_id=conv)
        await self.references.index(owner, added, ("conversation", key))
