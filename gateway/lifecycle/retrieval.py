"""What a client can do with a response after creating it: ``GET`` (polled or streamed), its
input items, ``DELETE`` and ``cancel``, wherever it runs or is kept (in flight here, a job on any
replica, in flight on another replica, or stored). Another tenant's ids are unknown here."""

from __future__ import annotations

from typing import Any

from ..http.errors import ApiError, invalid
from ..store.protocols import EventReader, JobState, ResponseStore
from ..store.responses import StoredResponse
from ..store.stores import Stores
from .generation import Generation
from .jobs import BackgroundJobs


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", code="not_found", param="response_id")


class Retrieval:
    def __init__(self, stores: Stores, inflight: dict[str, Generation], jobs: BackgroundJobs) -> None:
        self.stores = stores
        self.inflight = inflight  # foreground responses in flight on this replica
        self.jobs = jobs

    def _require_store(self) -> ResponseStore:
        store = self.stores.responses
        if store is None:
            raise ApiError(404, "Responses are not stored on this gateway.", code="not_found")
        if not store.enabled:
            raise invalid("The response store is disabled on this server (--responses-store-max-entries 0).")
        return store

    async def _lookup(self, response_id: str, owner: Any) -> tuple[JobState | None, Generation | None, StoredResponse | None]:
        """What the id names, as far as ``owner`` may see it (another tenant's ids are unknown)."""
        store = self._require_store()
        generation = self.inflight.get(response_id)
        if generation is not None and generation.owner != owner:
            generation = None
        # The stored object first: a job's final object is stored as the job ends (in one step),
        # so a stored response is never also a running job, and the common read is one round trip.
        stored = await store.get(response_id)
        job = await self.stores.jobs.get(response_id) if stored is None else None
        if job is not None and job.owner != owner:
            job = None
        if stored is not None and stored.owner != owner:
            stored = None
        return job, generation, stored

    async def _live_elsewhere(self, response_id: str, owner: Any) -> dict[str, Any] | None:
        """The opening snapshot of a foreground response another replica runs for ``owner``."""
        found = await self.stores.live.get(response_id)
        if found is None or found[0] != owner:
            return None
        return found[1]

    async def get(self, response_id: str, owner: Any = None) -> dict[str, Any]:
        job, generation, stored = await self._lookup(response_id, owner)
        if job is not None:
            return job.view
        if generation is not None and generation.request.store:
            return generation.response.snapshot()
        if stored is not None:
            return stored.response
        live = await self._live_elsewhere(response_id, owner)
        if live is not None and live.get("store", True):
            return live  # in progress on another replica: no partial output, as a poll
        raise not_found(response_id)

    async def event_stream(self, response_id: str, owner: Any = None) -> EventReader:
        """The recorded (and live) events of a response the owner may see; 404 when it has
        none: streamed retrieval covers background jobs and stored foreground streams."""
        job, generation, stored = await self._lookup(response_id, owner)
        if job is None and generation is None and stored is None:
            live = await self._live_elsewhere(response_id, owner)
            if live is None or not live.get("store", True):
                raise not_found(response_id)
        if generation is not None and not generation.request.store:
            raise not_found(response_id)
        reader = await self.stores.events.reader(response_id)
        if reader is None:
            raise invalid(f"Response '{response_id}' has no events to stream: streamed retrieval covers background responses and streamed stored responses, while their events are kept.",
                param="stream")
        return reader

    async def input_items(self, response_id: str, owner: Any = None) -> list[dict[str, Any]]:
        job, _, stored = await self._lookup(response_id, owner)
        if job is not None:
            return job.input_items
        if stored is None:
            raise not_found(response_id)
        return stored.input_items

    async def delete(self, response_id: str, owner: Any = None) -> dict[str, Any]:
        job, _, stored = await self._lookup(response_id, owner)
        if job is not None:
            raise invalid(f"Response '{response_id}' is still running (status: {job.view.get('status')}); cancel it first.")
        if stored is None or not await self._require_store().delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str, owner: Any = None) -> dict[str, Any]:
        store = self._require_store()
        job, generation, stored = await self._lookup(response_id, owner)
        if job is not None:
            running = self.stores.jobs.active.get(response_id)
            if running is not None:
                await self.jobs.cancel(running)
            else:
                await self.stores.jobs.cancel_elsewhere(response_id, job)  # through the replica running it
            stored = await store.get(response_id)
            return stored.response if stored is not None else dict(job.view, status="cancelled")
        if generation is not None:
            return _cancel_foreground(generation)
        if stored is None and await self._live_elsewhere(response_id, owner) is not None:
            cancelled = await self.stores.live.cancel_elsewhere(response_id)
            if cancelled is not None:
                return cancelled
            stored = await store.get(response_id)  # it finished meanwhile
            if stored is not None and stored.owner != owner:
                stored = None
        if stored is None:
            raise not_found(response_id)
        if stored.response.get("status") == "cancelled":
            return stored.response
        raise invalid(f"Response '{response_id}' has already finished (status: {stored.response.get('status')}); only in-flight responses can be cancelled.")

    async def cancel_here(self, response_id: str) -> dict[str, Any] | None:
        """A cancel sent by another replica for a response this one runs: the job's or response's
        state after cancelling, or None when it does not run here (any more)."""
        job = self.stores.jobs.active.get(response_id)
        if job is not None:
            await self.jobs.cancel(job)
            return {"id": response_id, "status": job.response.status}
        generation = self.inflight.get(response_id)
        return _cancel_foreground(generation) if generation is not None else None


def _cancel_foreground(generation: Generation) -> dict[str, Any]:
    generation.cancel()
    generation.response.cancel()
    snapshot: dict[str, Any] = generation.response.snapshot()
    return snapshot
