"""Background responses (spec: Background Mode) as this replica runs them: admission, the task
that drives one to its end, cancelling it, and failing them all at shutdown. Where jobs are
tracked across replicas is the job board's (store/background.py, store/redis/jobs.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..http.errors import ApiError, invalid
from ..pool.workers import NoWorker, WorkerPool, routing_key
from ..settings import Settings
from ..store.background import job_view
from ..store.lru import approx_bytes
from ..store.protocols import Job, StoreUnavailable
from ..store.stores import Stores
from .compaction import compaction_phase
from .generation import Generation, GenerationFailed, terminal_event
from .history import TERMINAL
from .persistence import Persistence

log = logging.getLogger("kiln.gateway.responses")

# Failure codes of a background job, as the spec lists them.
_JOB_CODES = {
    "server_is_overloaded": "server_overloaded",
    "context_length_exceeded": "invalid_prompt",
    "invalid_prompt": "invalid_prompt",
    "invalid_request_error": "invalid_prompt",
}


class BackgroundJobs:
    def __init__(self, settings: Settings, pool: WorkerPool, stores: Stores, persistence: Persistence) -> None:
        self.settings = settings
        self.pool = pool
        self.stores = stores
        self.persistence = persistence

    def check_allowed(self) -> None:
        """Refuse ``background`` where it cannot be kept (called while preparing a create)."""
        s, store = self.settings, self.stores.responses
        if store is None or not store.enabled:
            raise invalid("'background' needs the response store, which is disabled on this server.", param="background")
        if s.responses_background_max_jobs == 0 or s.responses_store_max_bytes == 0:
            raise invalid("Background mode is disabled on this server.", param="background")

    async def start(self, generation: Generation, own_input: list[dict[str, Any]]) -> dict[str, Any]:
        """Admit the job and start its task; the queued object a create answers with."""
        response = generation.response
        response.data["status"] = "queued"
        request = generation.request
        reserved = approx_bytes(request.to_json()) + 4 * (request.max_output_tokens or 1024)
        job = Job(response, generation, request.input, own_input, reserved, extra={"owner": generation.owner})
        jobs = self.stores.jobs
        await jobs.admit(job)  # 429 past the deployment's job or byte limits (before 503)
        try:
            worker = self.pool.pick(generation.model, routing_key(request, generation.options.session))
        except NoWorker:
            await jobs.withdraw(job)
            raise ApiError(503, f"No worker is serving model '{generation.model}' right now.", code="server_is_overloaded") from None
        if worker.overloaded():
            await jobs.withdraw(job)
            raise ApiError(503, "The generation queue is full; retry shortly.", code="server_is_overloaded")
        job.events = self.stores.events.open(response.id, generation.owner)
        job.events.record({"type": "response.created", "response": job_view(response)})
        await job.events.flush()  # readable by streamed retrieval on any replica from now on
        job.task = asyncio.create_task(self._run(job), name=f"kiln-job-{response.id}")
        return job_view(response)

    async def _run(self, job: Job) -> None:
        response, generation, events = job.response, job.generation, job.events
        try:
            try:
                await compaction_phase(self.pool, generation, self.settings.first_event_timeout_s)
            except ApiError as error:
                # context_management runs inside the job: its failure fails the job.
                raise GenerationFailed(error.status, "invalid_prompt" if error.status == 400 else (error.code or "server_error"), error.message) from error
            await generation.open()
            if response.status == "queued":
                response.data["status"] = "in_progress"
                await self.stores.jobs.update(job, job_view(response))
            events.record({"type": "response.in_progress", "response": job_view(response)})
            async for event in generation.events():
                if response.status == "queued":
                    response.data["status"] = "in_progress"
                events.record(event)
        except GenerationFailed as failure:
            response.fail(_JOB_CODES.get(failure.code, "server_error"), failure.message)
        except ApiError as error:
            response.fail("server_overloaded" if error.status == 503 else "server_error", error.message)
        except asyncio.CancelledError:
            generation.cancel()
            if job.extra.get("shutdown"):
                response.fail("server_error", "The gateway replica running this background response shut down before it finished.")
            else:
                response.cancel()
        except Exception as exc:  # a job must always end terminal
            log.exception("background job failed")
            response.fail("server_error", str(exc))
        finally:
            if response.status not in TERMINAL:
                response.cancel() if generation.cancelled else response.fail("server_error", "generation ended without a result")
            try:
                await self.persistence.persist(response, generation.request, job.own_input, job=job, owner=generation.owner)
            except StoreUnavailable:
                log.error("background response not stored: the store is unavailable", extra={"response_id": response.id})
            if job.extra.get("taken_over"):
                await self.stores.events.discard(response.id)  # the replica that took it ended its stream
            else:
                await self.stores.events.finish(response.id, terminal_event(response))

    async def cancel(self, job: Job) -> None:
        """Cancel a job this replica runs and wait until its final object is stored."""
        job.stop()
        if job.task is not None:
            try:
                await job.task
            except (asyncio.CancelledError, Exception):
                pass

    async def shutdown(self) -> None:
        """This replica's jobs end ``failed`` now (stored, so that a poll on another replica sees
        it at once rather than after the lease)."""
        jobs = list(self.stores.jobs.active.values())
        for job in jobs:
            job.extra["shutdown"] = True
            job.stop()
        await asyncio.gather(*(job.task for job in jobs if job.task is not None), return_exceptions=True)
