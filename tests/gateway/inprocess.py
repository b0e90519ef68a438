"""The gateway app in-process, with a fake worker pool: for tests that send many hostile bodies.

Starting real processes per example would make a fuzzer take minutes; here each request is one
ASGI call. ``FakePool`` is the real ``WorkerPool`` with the socket replaced: every message the
gateway sends is msgpack-encoded and decoded as on the wire (so what a real worker could not
receive fails here too), and the fake worker answers at once: ``Done`` for a generation, a fixed
``TokenCount``, a trivial ``Compacted``. ``channels`` and each worker's ``inflight`` must be empty
once a foreground request has answered; a leak is visible there.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from kiln.gateway.http.app import create_app
from kiln.gateway.pool.workers import WorkerHandle, WorkerPool
from kiln.gateway.settings import Settings
from kiln.protocol import Compact, Compacted, CountTokens, Done, Generate, Register, TokenCount, decode, encode
from kiln.protocol.usage import Usage

MODEL = "kiln-fake"
CONTEXT_WINDOW = 8192
# Every request must answer within this (seconds); the fake worker answers at once.
ANSWER_BOUND_S = 20.0


class FakePool(WorkerPool):
    """A WorkerPool with one registered fake worker and no socket."""

    def __init__(self, context_window: int = CONTEXT_WINDOW) -> None:
        super().__init__("inproc://kiln-fake-unused")
        info = Register(worker_id="fake", model=MODEL, aliases=[], context_window=context_window, capacity=64, queue_depth=64)
        self.worker = WorkerHandle(b"fake", info, time.monotonic())
        self.workers[b"fake"] = self.worker

    async def start(self) -> None:  # no socket, no liveness loop: the fake worker never dies
        return None

    async def stop(self) -> None:
        return None

    async def _send(self, identity: bytes, message: Any) -> None:
        message = decode(encode(message))  # what a real worker would have received
        reply: Any = None
        if isinstance(message, Generate):
            reply = Done(message.req_id, "completed", Usage(input_tokens=3))
        elif isinstance(message, CountTokens):
            reply = TokenCount(message.req_id, 3)
        elif isinstance(message, Compact):
            usage = Usage(input_tokens=3, output_tokens=1)
            reply = Compacted(message.req_id, "summary", [], [], 3, 1, usage)
        if reply is not None:
            await self._dispatch(identity, reply)

    def leaked(self) -> list[str]:
        """Request ids still registered (none once every foreground request has answered)."""
        return sorted(set(self.channels) | self.worker.inflight)


def local_app(**settings: Any):
    pool = FakePool()
    return create_app(Settings(**settings), pool=pool), pool


def client_for(app, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions), base_url="http://127.0.0.1", timeout=ANSWER_BOUND_S)


async def bounded(coro: Any) -> Any:
    """Await a request, failing the test (not hanging it) past ``ANSWER_BOUND_S``."""
    return await asyncio.wait_for(coro, ANSWER_BOUND_S)


async def hosted_app(tmp: Path, *, admin_token: str = "admin-secret") -> tuple[Any, FakePool, str]:
    """An ``--auth keys`` app on a fresh SQLite accounts DB, opened, with one funded org.

    Returns (app, pool, api_key). The caller closes it with ``await app.state.accounts.close()``.
    """
    from kiln.gateway.accounts.keys import create_key
    from kiln.gateway.accounts.orgs import create_org

    settings = Settings(auth="keys", database_url=f"sqlite:///{tmp}/accounts.db", store_mode="none", admin_token=admin_token)
    pool = FakePool()
    app = create_app(settings, pool=pool)
    accounts = app.state.accounts
    await accounts.open()
    await create_org(accounts.db, "acme", credits_usd=10)
    key = (await create_key(accounts.db, "acme")).key
    return app, pool, key
