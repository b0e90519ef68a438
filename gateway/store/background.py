"""Admission bookkeeping for background jobs (spec: Background Mode).

Active jobs live outside the response store's LRU and TTL, so a running job is never evicted;
their approximate bytes count against the store's byte budget at admission instead.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..errors import ApiError


@dataclass
class Job:
    response: Any  # ResponseObject
    generation: Any  # Generation
    input_items: list[dict]
    own_input: list[dict]
    reserved_bytes: int
    task: asyncio.Task | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class JobRegistry:
    def __init__(self, max_jobs: int, max_bytes: int) -> None:
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.active: dict[str, Job] = {}
        self.active_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_jobs > 0 and self.max_bytes > 0

    def check(self, reserved_bytes: int) -> None:
        """Raise 429 when a job of this size cannot be admitted now."""
        if len(self.active) >= self.max_jobs:
            raise ApiError(429, f"{self.max_jobs} background responses are already running; retry after one finishes.", code="rate_limit_exceeded")
        if self.active_bytes + reserved_bytes > self.max_bytes:
            raise ApiError(429, "Active background responses fill the response store's byte budget; retry after one finishes.", code="rate_limit_exceeded")

    def admit(self, job: Job) -> None:
        self.check(job.reserved_bytes)
        self.active[job.response.id] = job
        self.active_bytes += job.reserved_bytes

    def release(self, response_id: str) -> None:
        job = self.active.pop(response_id, None)
        if job is not None:
            self.active_bytes -= job.reserved_bytes

    def get(self, response_id: str) -> Job | None:
        return self.active.get(response_id)
