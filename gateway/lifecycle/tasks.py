"""Stopping background tasks at shutdown, within a bound.

Why not ``task.cancel()`` and a gather: a cancellation can be swallowed. redis-py's pub/sub read
swallowed one (where in redis-py was not pinned down); the cancel listener stayed ``cancelling``
and read on, and the replica's shutdown waited on it for good (CI's run hung in
tests/gateway/test_store_redis.py, about one run of the module in five under load). So a task is
cancelled again each round until it has ended, and one still running after the bound is logged
and left behind rather than holding shutdown up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("kiln.gateway")

# Twice the longest single Redis wait (a 2 s socket timeout plus a 1 s block).
STOP_WAIT_S = 6.0


async def stop_tasks(tasks: Iterable[asyncio.Task[Any] | None], wait_s: float = STOP_WAIT_S) -> None:
    """Cancel ``tasks`` (None: no task) and wait until they have ended, cancelling again every
    0.25 s, for at most ``wait_s``; a task still running then is logged and left behind."""
    pending = {t for t in tasks if t is not None and not t.done()}
    deadline = time.monotonic() + wait_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - time.monotonic()
        if left <= 0:
            log.error("background tasks did not stop", extra={"tasks": sorted(t.get_name() for t in pending)})
            return
        _, pending = await asyncio.wait(pending, timeout=min(0.25, left))
