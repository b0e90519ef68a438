"""Foreground responses in flight on other replicas: none with one process (``--store memory``
keeps its in-flight responses in ``ResponsesService.inflight`` alone); ``redis/live.py`` is the
shared registry."""

from __future__ import annotations

from typing import Any


class LocalLiveRegistry:
    async def add(self, response_id: str, owner: Any, snapshot: dict[str, Any], *, required: bool) -> None:
        return None

    async def discard(self, response_id: str) -> None:
        return None

    async def get(self, response_id: str) -> tuple[Any, dict[str, Any]] | None:
        return None

    async def cancel_elsewhere(self, response_id: str) -> dict[str, Any] | None:
        return None
