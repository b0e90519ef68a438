"""What the gateway asks of its stores, one Protocol per store, so that no code outside
``gateway/store/`` knows whether state lives in this process (``--store memory``) or in Redis
shared by every replica (``--store redis``).

Every method that reads or writes shared state is a coroutine (Redis is across a socket); the
memory stores answer at once. A store that cannot reach its backend raises
``StoreUnavailable`` (a 503 in the API's error shape), never a backend exception.

``backend.py`` builds one set of these from the settings (``stores.py``); ``lifecycle/`` is the only
user of most of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..http.errors import ApiError

if TYPE_CHECKING:
    from .conversations import Conversation
    from .responses import StoredResponse


class StoreUnavailable(ApiError):
    """The shared store did not answer (down, or slower than its socket timeout).

    The request needed it, so it is refused as a 503 the client can retry; nothing was half
    written (every multi-key write is one Redis script)."""

    def __init__(self, what: str = "response store") -> None:
        super().__init__(503, f"The {what} is unavailable. Retry with exponential backoff.", headers={"Retry-After": "2"})


class ResponseStore(Protocol):
    """Stored responses with their input items (spec: Storage Flags)."""

    @property
    def enabled(self) -> bool: ...

    @property
    def max_bytes(self) -> int: ...

    async def put(self, stored: StoredResponse) -> bool:
        """Keep a ``StoredResponse`` (response and input items in one write); False when it
        alone is larger than the byte budget or the store is off."""

    async def get(self, response_id: str) -> StoredResponse | None:
        """The ``StoredResponse``, or None (unknown, evicted or expired)."""

    async def delete(self, response_id: str) -> bool: ...

    def size_of(self, stored: StoredResponse) -> int:
        """What ``stored`` costs against the byte budget (so a caller can swap in a stub)."""

    async def stats(self) -> dict[str, int]:
        """``entries``, ``bytes`` and ``max_bytes``, for /health."""


class ConversationStore(Protocol):
    """Conversations and their items (``/v1/conversations`` and ``conversation`` on create).

    ``key`` is the owner-scoped key of ``history.conversation_key``. Appends are atomic per call,
    so turns written by two replicas at once both land."""

    @property
    def enabled(self) -> bool: ...

    @property
    def max_bytes(self) -> int:
        """The byte budget of the whole store (an organization may fill ``OWNER_SHARE`` of it)."""

    async def create(self, key: str, conv: Conversation) -> bool: ...

    async def get(self, key: str) -> Conversation | None:
        """The ``Conversation`` with its items, or None."""

    async def header(self, key: str) -> Conversation | None:
        """The ``Conversation`` without its items (id, created time, metadata), or None: what an
        existence check or the resource needs, at a cost that does not grow with the items."""

    async def delete(self, key: str) -> bool: ...

    async def set_metadata(self, key: str, metadata: dict[str, str]) -> Conversation | None: ...

    async def add_items(self, key: str, items: list[dict[str, Any]], *, conversation_id: str | None = None) -> list[dict[str, Any]]:
        """Append items (as resources), starting the conversation if it does not exist; returns
        the resources added. ``ConversationFull`` (nothing written) when they do not fit."""

    async def delete_item(self, key: str, item_id: str) -> Conversation | None:
        """The conversation without the item, or None when either is unknown."""

    async def transcript(self, key: str) -> list[dict[str, Any]]:
        """The items as input items to render (empty for an unknown conversation)."""

    async def replace(self, key: str, items: list[dict[str, Any]], *, conversation_id: str | None = None) -> list[dict[str, Any]]:
        """Swap the items for a compacted history; returns the new resources.
        ``ConversationFull`` (nothing written) when they do not fit."""


class ReasoningEcho(Protocol):
    """The reasoning echo store (spec: Streaming Events). Best effort: it only serves the prefix
    cache, so a backend that is down makes it forget, never fail a request."""

    async def remember(self, output: list[dict[str, Any]], owner: Any = None) -> None: ...

    async def restore(self, items: list[dict[str, Any]], owner: Any = None) -> list[dict[str, Any]]: ...


class ItemIndex(Protocol):
    """Which stored response or conversation holds an item id (for ``item_reference``)."""

    async def add(self, owner: Any, items: list[dict[str, Any]], holder: tuple[str, str]) -> None: ...

    async def lookup(self, owner: Any, item_id: str) -> tuple[str, str] | None: ...


@dataclass
class JobState:
    """A running background job as any replica sees it."""

    view: dict[str, Any]  # the poll view: status queued or in_progress, no partial output
    input_items: list[dict[str, Any]]
    owner: Any  # the organization that may see it
    replica: str  # the replica running it
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Job:
    """A background job this replica runs (``JobState`` is how every replica sees one)."""

    response: Any  # ResponseObject
    generation: Any  # Generation
    input_items: list[dict[str, Any]]
    own_input: list[dict[str, Any]]
    reserved_bytes: int
    task: asyncio.Task[None] | None = None
    events: Any = None  # its EventRecorder (streamed retrieval)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def owner(self) -> Any:
        return self.extra.get("owner")

    def stop(self) -> None:
        """Cancel its generation and its task (which then stores its final object)."""
        self.generation.cancel()
        if self.task is not None:
            self.task.cancel()


class JobBoard(Protocol):
    """Background jobs: admission against the deployment's limits, their poll state, the end
    of each job, and reaching the replica that runs one.

    ``active`` holds the jobs this replica runs (their tasks and generations); the state every
    replica can read is ``get``'s."""

    active: dict[str, Job]

    async def admit(self, job: Job) -> None:
        """Take a job in; 429 ``rate_limit_exceeded`` when the job count or byte budget is full."""

    async def withdraw(self, job: Job) -> None:
        """Undo an admission: the job could not start (no worker), nothing is stored."""

    async def update(self, job: Job, view: dict[str, Any]) -> None:
        """The job's poll view changed (queued -> in_progress)."""

    async def finish(self, job: Job, final: StoredResponse) -> bool:
        """End a job: store its final ``StoredResponse`` and drop the job in one step. False when
        this replica no longer owns it (another replica failed or cancelled it meanwhile)."""

    async def get(self, response_id: str) -> JobState | None: ...

    async def cancel_elsewhere(self, response_id: str, state: JobState) -> None:
        """Cancel a job another replica runs and return once it is terminal in the store; a
        replica that does not answer in time has the job cancelled for it."""

    async def stats(self) -> dict[str, int]:
        """``active`` jobs and their reserved ``active_bytes`` (the deployment's), for /health."""


class LiveRegistry(Protocol):
    """Foreground responses in flight on any replica, so that cancel and GET reach them."""

    async def add(self, response_id: str, owner: Any, snapshot: dict[str, Any], *, required: bool) -> None:
        """Register a response this replica runs; ``required`` raises StoreUnavailable when it
        cannot be registered (a stored response that could not be kept anyway)."""

    async def discard(self, response_id: str) -> None: ...

    async def get(self, response_id: str) -> tuple[Any, dict[str, Any]] | None:
        """(owner, snapshot) of a response another replica runs, or None."""

    async def cancel_elsewhere(self, response_id: str) -> dict[str, Any] | None:
        """Ask the replica running it to cancel; its snapshot after cancelling, or None when no
        replica runs it (anymore)."""


class EventRecorder(Protocol):
    """Where one response's numbered events go while it runs (sync: called per event)."""

    def record(self, event: dict[str, Any]) -> dict[str, Any]:
        """Number ``event`` and keep it; returns the numbered event."""

    def keep(self, stamped: dict[str, Any]) -> None:
        """Keep an event numbered elsewhere (a live stream's sequencer)."""

    async def flush(self) -> bool:
        """Wait (bounded) until what was recorded is readable by any reader."""


class EventReader(Protocol):
    def follow(self, starting_after: int | None) -> AsyncIterator[dict[str, Any]]:
        """Events after ``starting_after`` then live ones to the terminal event; raises
        ``events.TooOld`` before yielding when events after it are no longer kept."""


class EventLog(Protocol):
    """Per-response event buffers for streamed retrieval."""

    def open(self, response_id: str, owner: Any = None) -> EventRecorder:
        """Record ``response_id``'s events; ``owner``'s finished streams count against its share."""

    async def finish(self, response_id: str, terminal: dict[str, Any] | None = None) -> None:
        """The response ended: record ``terminal`` unless one was, and keep it readable a while."""

    async def reader(self, response_id: str) -> EventReader | None: ...

    async def discard(self, response_id: str) -> None:
        """Stop recording without a terminal event (the response was ended elsewhere)."""
