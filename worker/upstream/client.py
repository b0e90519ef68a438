"""HTTP to the engine: its health, and one streamed completion as parsed server-sent events.

Closing the stream closes the connection, which is how each engine learns a request was
abandoned (llama-server frees the slot, vLLM and SGLang abort the sequence), so cancelling the
task reading a stream is cancelling the upstream request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from .requests import HEALTH_PATH, UpstreamCall
from .responses import UpstreamError

# Bounds on every wait: a connection the engine does not accept, and the silence between two
# chunks of one stream (a long prompt's prefill included). The gateway's own deadlines end most
# requests sooner; these keep a worker from waiting on a wedged engine forever.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 2.0
MAX_ERROR_BYTES = 2048  # of an error answer's body, kept for the log


class UpstreamClient:
    def __init__(self, base_url: str, *, connections: int, api_key: str | None = None) -> None:
        limits = httpx.Limits(max_connections=connections + 2, max_keepalive_connections=connections + 2)
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), limits=limits, timeout=timeout, headers=headers)

    async def healthy(self) -> bool:
        try:
            answer = await self.http.get(HEALTH_PATH, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return answer.status_code == 200

    async def stream(self, call: UpstreamCall) -> AsyncIterator[dict[str, Any]]:
        """The JSON object of each server-sent event until ``[DONE]`` or the end of the body.
        Raises UpstreamError for an error status, a broken connection or a malformed event."""
        try:
            async with self.http.stream("POST", call.path, json=call.body) as answer:
                if answer.status_code != 200:
                    body = (await answer.aread())[:MAX_ERROR_BYTES].decode("utf-8", "replace")
                    raise UpstreamError(f"the engine answered {answer.status_code}: {body}", answer.status_code)
                async for line in answer.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, "event:" lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        event = json.loads(data)
                    except ValueError:
                        raise UpstreamError("the engine sent an event that is not JSON") from None
                    if not isinstance(event, dict):
                        raise UpstreamError("the engine sent an event that is not a JSON object")
                    yield event
        except httpx.HTTPError as exc:
            raise UpstreamError(f"the engine connection failed: {type(exc).__name__}") from exc

    async def close(self) -> None:
        await self.http.aclose()
