"""Shutdown stops background tasks (gateway/lifecycle/tasks.py) even when a cancellation is swallowed.

redis-py's pub/sub read swallowed a cancel (where in redis-py was not pinned down): the cancel
listener stayed ``cancelling`` and read on, and the replica's shutdown waited on it for good (a
CI run hung there). ``stop_tasks`` cancels again until the task ends, within a bound.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kiln.gateway.lifecycle.tasks import stop_tasks


async def test_a_task_that_swallows_one_cancel_is_still_stopped():
    swallowed = asyncio.Event()

    async def listener() -> None:  # what the cancel listener did inside redis-py
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed.is_set():
                    raise
                swallowed.set()

    task = asyncio.create_task(listener())
    await asyncio.sleep(0.02)
    await asyncio.wait_for(stop_tasks([task]), 3)
    assert swallowed.is_set() and task.cancelled()


async def test_a_task_that_never_ends_is_left_behind_within_the_bound():
    released = asyncio.Event()

    async def deaf() -> None:
        while not released.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("kiln.gateway")
    logger.addHandler(handler)
    task = asyncio.create_task(deaf(), name="deaf")
    await asyncio.sleep(0.02)  # running: a task cancelled before its first step just ends
    started = time.monotonic()
    try:
        await stop_tasks([task], wait_s=0.3)
    finally:
        logger.removeHandler(handler)
    assert time.monotonic() - started < 1.0
    assert not task.done()
    assert [r.getMessage() for r in records] == ["background tasks did not stop"] and records[0].tasks == ["deaf"]
    released.set()  # not leaked into the next test
    await asyncio.wait_for(task, 1)


async def test_ended_and_ordinary_tasks_stop_at_once():
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    sleeper = asyncio.create_task(asyncio.sleep(60))
    started = time.monotonic()
    await stop_tasks([done, sleeper])
    assert sleeper.cancelled() and time.monotonic() - started < 0.5
