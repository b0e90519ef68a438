"""``truncation: "auto"``: drop the oldest whole turns until the input fits the context window.

The spec refuses ``auto`` (a request is never silently shortened), so it is accepted only on a
gateway started with ``--truncation-auto``, for clients that always send it (the OpenAI Agents
SDK's setting). Only what the worker renders is shortened; the input and history a response
stores stay whole. System and developer messages are always kept, and so is everything from the
latest user message on. A cut falls only before a user message or right after a finished tool
group (the same rule as compaction's split), so a call never loses its output. When even the
latest turn alone does not fit, the request goes on with it and the worker answers its usual 400.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

from ..doors.create_request import CreateRequest
from ..doors.options import NO_OPTIONS, DoorOptions
from ..http.errors import ApiError
from ..pool.workers import WorkerPool
from .generation import count_tokens

Count = Callable[[list[dict[str, Any]]], Awaitable[int]]


def worker_count(pool: WorkerPool, request: CreateRequest, model: str, timeout_s: float | None, options: DoorOptions = NO_OPTIONS) -> Count:
    """Count ``request`` with other input on a worker; an input the worker refuses as longer than
    the window counts as too long (it answers that before tokenizing a provably long one)."""

    async def count(items: list[dict[str, Any]]) -> int:
        try:
            return await count_tokens(pool, request, items, model, timeout_s, options)
        except ApiError as exc:
            if exc.status == 400 and exc.code == "context_length_exceeded":
                return sys.maxsize
            raise

    return count


def _is_system(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") in ("system", "developer")


def _is_user(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") == "user"


def cut_points(conversation: list[dict[str, Any]]) -> list[int]:
    """Positions where the conversation may start after the oldest turns are dropped, oldest
    first, never past the latest user message."""
    users = [pos for pos, item in enumerate(conversation) if _is_user(item)]
    last = users[-1] if users else len(conversation) - 1
    points = []
    for pos in range(1, last + 1):
        previous, item = conversation[pos - 1], conversation[pos]
        after_tool_group = previous.get("type") == "function_call_output" and item.get("type") != "function_call_output"
        if _is_user(item) or after_tool_group:
            points.append(pos)
    return points


async def fit(items: list[dict[str, Any]], count: Count, window: int) -> list[dict[str, Any]]:
    """``items`` without the fewest oldest turns that makes them fit ``window`` with room for at
    least one output token; ``count`` renders and counts a candidate (a worker round trip, so the
    cut is found by bisection: about log2(turns) counts)."""

    def fits(n: int) -> bool:
        return n < window - 1

    if fits(await count(items)):
        return items
    system = [i for i in items if _is_system(i)]
    conversation = [i for i in items if not _is_system(i)]
    points = cut_points(conversation)
    if not points:
        return items
    low, high = 0, len(points) - 1  # the answer is points[high] unless an earlier one fits
    while low < high:
        mid = (low + high) // 2
        if fits(await count(system + conversation[points[mid] :])):
            high = mid
        else:
            low = mid + 1
    return system + conversation[points[high] :]
