"""Background jobs shared by the replicas: owned under a lease, readable and cancellable from any
replica, never left ``in_progress`` by a replica that died.

A job is ``NS:job:<id>`` (its replica, organization, poll view and input items) plus its lease in
``NS:jobs:lease``; the job count and the reserved bytes (``NS:jobs:bytes``) are the deployment's,
so ``--responses-background-max-jobs`` and the byte budget hold across replicas.

With ``lease`` L (``--responses-background-lease-secs``): the replica running a job renews its
lease every L/4 to L*3/4 from now (two renewals may be missed); every replica sweeps every L/4
for leases that ended, takes the job over and ends it ``failed`` with ``server_error``. A replica
that stops is therefore noticed within L of its last renewal. Ending a job stores its final
object and drops the job in one script, only for the replica that owns it: a replica whose job was
taken over meanwhile (it lost its lease, or did not answer a cancel) learns so and stops it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from ...lifecycle.tasks import stop_tasks
from ..background import budget_full, job_view, too_many_jobs
from ..protocols import Job, JobState
from ..responses import StoredResponse
from . import scripts
from .cancel import CancelChannel
from .codec import dumps, loads
from .connection import BACKEND_ERRORS, RedisContext, guarded
from .connection import text as _text
from .events import RedisEventLog
from .responses import RedisResponseStore

log = logging.getLogger("kiln.gateway.store")

CANCEL_WAIT_S = 5.0  # how long a cancel waits for the owner before taking the job over
SWEEP_BATCH = 16
REPLICA_STOPPED = "The gateway replica running this background response stopped before it finished."


class RedisJobBoard:
    def __init__(self, ctx: RedisContext, responses: RedisResponseStore, events: RedisEventLog, cancels: CancelChannel, *, max_jobs: int, max_bytes: int, lease_s: float) -> None:
        self.ctx = ctx
        self.responses = responses
        self.events = events
        self.cancels = cancels
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.lease_s = lease_s
        self.valid_ms = max(1, int(lease_s * 750))  # a renewal holds the lease for 3/4 of it
        self.renew_every_s = lease_s / 4
        self.active: dict[str, Job] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- the owner's side ---------------------------------------------------------------------
    @guarded
    async def admit(self, job: Job) -> None:
        rid = job.response.id
        ephemeral = not job.generation.request.store
        verdict = await self.ctx.run(
            scripts.JOB_ADMIT, self.ctx.keys.ns, rid, self.ctx.replica, dumps({"owner": job.owner, "ephemeral": ephemeral}),
            dumps(job_view(job.response)), dumps(job.input_items), job.reserved_bytes, self.max_jobs, self.max_bytes, self.valid_ms,
        )
        if int(verdict) == 1:
            raise too_many_jobs(self.max_jobs)
        if int(verdict) == 2:
            raise budget_full()
        self.active[rid] = job

    async def withdraw(self, job: Job) -> None:
        self.active.pop(job.response.id, None)
        try:
            await self.ctx.run(scripts.JOB_WITHDRAW, self.ctx.keys.ns, job.response.id, self.ctx.replica)
        except BACKEND_ERRORS as exc:  # its lease ends on its own; the sweeper then drops it
            log.warning("job admission not undone: redis unavailable", extra={"response_id": job.response.id, "error": str(exc)})

    async def update(self, job: Job, view: dict[str, Any]) -> None:
        try:
            await self.ctx.run(scripts.JOB_UPDATE, self.ctx.keys.ns, job.response.id, self.ctx.replica, dumps(view))
        except BACKEND_ERRORS as exc:  # the poll view lags; the job goes on
            log.warning("job view not updated: redis unavailable", extra={"response_id": job.response.id, "error": str(exc)})

    async def finish(self, job: Job, final: StoredResponse) -> bool:
        """Store the final object and end the job, retrying while Redis is away (for at most a
        lease: after that another replica has failed the job)."""
        self.active.pop(job.response.id, None)
        return await self._finish(job.response.id, final, retry_for_s=self.lease_s)

    async def _finish(self, rid: str, final: StoredResponse, *, retry_for_s: float = 0.0) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + retry_for_s
        delay = 0.1
        while True:
            try:
                done = await self.ctx.run(scripts.JOB_FINISH, self.ctx.keys.ns, rid, self.ctx.replica, self.responses.prefix, *self.responses.put_args(final))
                return bool(done)
            except BACKEND_ERRORS as exc:
                if loop.time() + delay > deadline:
                    log.error("background response not stored: redis unavailable", extra={"response_id": rid, "error": str(exc)})
                    return False
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    # -- any replica's side -------------------------------------------------------------------
    @guarded
    async def get(self, response_id: str) -> JobState | None:
        replica, meta, view, items = await self.ctx.redis.hmget(self.ctx.keys.job(response_id), ["replica", "owner", "view", "input"])
        if replica is None or view is None:
            return None
        info = loads(meta) or {}
        return JobState(loads(view), loads(items) or [], info.get("owner"), _text(replica), extra={"ephemeral": bool(info.get("ephemeral"))})

    @guarded
    async def cancel_elsewhere(self, response_id: str, state: JobState) -> None:
        answer = await self.cancels.request(state.replica, response_id, CANCEL_WAIT_S)
        if answer:
            return  # the owner cancelled it and stored the result
        # Nobody runs it any more (or its replica did not answer): take it over and cancel it here.
        if await self.ctx.run(scripts.JOB_TAKE, self.ctx.keys.ns, response_id, self.ctx.replica, self.valid_ms):
            await self._end_taken(response_id, "cancelled")

    async def _end_taken(self, response_id: str, status: str) -> None:
        """End a job this replica took over (it runs nowhere): failed or cancelled, stored, and
        the terminal event appended to its stream."""
        state = await self.get(response_id)
        if state is None:
            return
        from ...lifecycle.response_object import zero_usage

        view = {**state.view, "status": status, "output": [], "usage": zero_usage()}
        if status == "failed":
            view["error"] = {"code": "server_error", "message": REPLICA_STOPPED}
        final = StoredResponse(view, state.input_items, ephemeral=state.extra.get("ephemeral", False), extra={"owner": state.owner})
        if await self._finish(response_id, final):
            await self.events.append_terminal(response_id, {"type": "response.failed", "response": view})
            log.warning("background response ended by another replica", extra={"response_id": response_id, "status": status, "replica": state.replica})

    # -- leases ---------------------------------------------------------------------------------
    async def open(self) -> None:
        self._tasks = [
            asyncio.create_task(self._renew_loop(), name=f"kiln-job-renew-{self.ctx.replica}"),
            asyncio.create_task(self._sweep_loop(), name=f"kiln-job-sweep-{self.ctx.replica}"),
        ]

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        await stop_tasks(tasks)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.renew_every_s)
            try:
                await self.renew()
            except Exception:  # the loop must outlive any one failure
                log.exception("job lease renewal failed")

    async def renew(self) -> None:
        """Extend the leases of this replica's jobs; stop those it lost."""
        ids = list(self.active)
        if not ids:
            return
        try:
            lost = await self.ctx.run(scripts.JOB_RENEW, self.ctx.keys.ns, self.ctx.replica, self.valid_ms, *ids)
        except BACKEND_ERRORS as exc:
            log.warning("job leases not renewed: redis unavailable", extra={"jobs": len(ids), "error": str(exc)})
            return
        for raw in lost:
            job = self.active.pop(raw.decode(), None)
            if job is not None:
                log.warning("background response taken over by another replica; stopping it here", extra={"response_id": job.response.id})
                job.extra["taken_over"] = True
                job.stop()

    async def _sweep_loop(self) -> None:
        await asyncio.sleep(random.uniform(0, self.renew_every_s))  # replicas sweep at different times
        while True:
            try:
                await self.sweep()
            except Exception:  # the loop must outlive any one failure
                log.exception("job sweep failed")
            await asyncio.sleep(self.renew_every_s)

    async def sweep(self) -> int:
        """Fail the jobs whose replica stopped renewing; how many were ended."""
        try:
            claimed = await self.ctx.run(scripts.JOB_CLAIM_EXPIRED, self.ctx.keys.ns, self.ctx.replica, self.valid_ms, SWEEP_BATCH)
            for raw in claimed:
                await self._end_taken(raw.decode(), "failed")
            return len(claimed)
        except BACKEND_ERRORS as exc:
            log.warning("job sweep skipped: redis unavailable", extra={"error": str(exc)})
            return 0

    async def stats(self) -> dict[str, int]:
        try:
            count, reserved = await asyncio.gather(self.ctx.redis.zcard(self.ctx.keys.job_leases), self.ctx.redis.get(self.ctx.keys.job_bytes))
        except BACKEND_ERRORS:
            return {"active_here": len(self.active)}
        return {"active": int(count), "active_bytes": int(reserved or 0), "active_here": len(self.active)}
