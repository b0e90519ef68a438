"""Background jobs (spec: Background Mode): admission against the job and byte limits, the
view a poll gets, and the end of a job.

Active jobs live outside the response store's LRU and TTL, so a running job is never evicted;
their approximate bytes count against the store's byte budget at admission instead.
``MemoryJobBoard`` is the JobBoard of one process; ``redis/jobs.py`` shares jobs between
replicas (leases, cancel across replicas, failing the jobs of a replica that died).
"""

from __future__ import annotations

from typing import Any

from ..http.errors import ApiError
from .protocols import Job, JobState, ResponseStore
from .responses import StoredResponse

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


def job_view(response: Any) -> dict[str, Any]:
    """A background response as a poll sees it: no partial output until terminal."""
    from ..lifecycle.response_object import zero_usage

    snapshot: dict[str, Any] = response.snapshot()
    if response.status not in TERMINAL:
        snapshot["output"] = []
        snapshot["usage"] = zero_usage()
    return snapshot


def too_many_jobs(max_jobs: int) -> ApiError:
    return ApiError(429, f"{max_jobs} background responses are already running; retry after one finishes.", code="rate_limit_exceeded")


def budget_full() -> ApiError:
    return ApiError(429, "Active background responses fill the response store's byte budget; retry after one finishes.", code="rate_limit_exceeded")


class MemoryJobBoard:
    def __init__(self, max_jobs: int, max_bytes: int, store: ResponseStore | None) -> None:
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.store = store
        self.active: dict[str, Job] = {}
        self.active_bytes = 0

    async def admit(self, job: Job) -> None:
        """Raise 429 when a job of this size cannot be admitted now."""
        if len(self.active) >= self.max_jobs:
            raise too_many_jobs(self.max_jobs)
        if self.active_bytes + job.reserved_bytes > self.max_bytes:
            raise budget_full()
        self.active[job.response.id] = job
        self.active_bytes += job.reserved_bytes

    async def withdraw(self, job: Job) -> None:
        if self.active.pop(job.response.id, None) is not None:
            self.active_bytes -= job.reserved_bytes

    async def update(self, job: Job, view: dict[str, Any]) -> None:
        return None  # a poll reads the live job itself

    async def finish(self, job: Job, final: StoredResponse) -> bool:
        await self.withdraw(job)
        if self.store is not None:
            await self.store.put(final)
        return True

    async def get(self, response_id: str) -> JobState | None:
        job = self.active.get(response_id)
        if job is None:
            return None
        return JobState(job_view(job.response), job.input_items, job.owner, "local")

    async def cancel_elsewhere(self, response_id: str, state: JobState) -> None:
        raise AssertionError("every job of a memory board runs in this process")

    async def stats(self) -> dict[str, int]:
        return {"active": len(self.active), "active_bytes": self.active_bytes}

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None
