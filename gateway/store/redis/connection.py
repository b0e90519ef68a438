"""The Redis connection of a gateway replica: bounded waits, key names, and the one place a
Redis failure becomes a 503.

Every wait on Redis is bounded: connecting (``CONNECT_TIMEOUT_S``) and each reply
(``SOCKET_TIMEOUT_S``), so a Redis that is down or stalled refuses a request in seconds instead
of hanging it. A command on a connection that broke (Redis restarted) is retried once, at once,
on a fresh connection: that is what makes recovery need no restart of the gateway. Blocking
reads (``XREAD BLOCK``, ``BLPOP``) use a second client whose socket timeout covers the longest
block (``BLOCK_S``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from ..protocols import StoreUnavailable

log = logging.getLogger("kiln.gateway.store")

CONNECT_TIMEOUT_S = 1.0
SOCKET_TIMEOUT_S = 2.0
BLOCK_S = 1.0  # the longest single XREAD BLOCK / BLPOP; callers loop for longer waits

T = TypeVar("T")
P = ParamSpec("P")
# What a Redis call can raise when the server is away (redis-py wraps most socket errors).
BACKEND_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError)


def connect(url: str, *, blocking: bool = False) -> Redis:
    """A client for ``url``; ``blocking`` for the one that waits in XREAD BLOCK and BLPOP."""
    return Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S + (BLOCK_S if blocking else 0.0),
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        health_check_interval=30,
    )


def text(raw: bytes | str) -> str:
    """A reply as text (the clients return bytes)."""
    return raw.decode() if isinstance(raw, bytes) else raw


def guarded(method: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """A store method whose Redis failure is a 503 ``StoreUnavailable`` (logged, never quoted to
    the client)."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except BACKEND_ERRORS as exc:
            log.warning("redis unavailable", extra={"operation": method.__qualname__, "error": str(exc) or type(exc).__name__})
            raise StoreUnavailable() from None

    return wrapper


class Keys:
    """Every key of one deployment, under ``--redis-namespace`` (replicas must share it)."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace

    # bounded stores: each has its entries under <prefix>:d:<id> and its bookkeeping beside them
    @property
    def responses(self) -> str:
        return f"{self.ns}:resp"

    @property
    def conversations(self) -> str:
        return f"{self.ns}:conv"

    @property
    def echo(self) -> str:
        return f"{self.ns}:echo"

    @property
    def items(self) -> str:
        return f"{self.ns}:items"

    def data(self, prefix: str, entry: str) -> str:
        return f"{prefix}:d:{entry}"

    # background jobs and foreground responses in flight
    def job(self, response_id: str) -> str:
        return f"{self.ns}:job:{response_id}"

    @property
    def job_leases(self) -> str:
        return f"{self.ns}:jobs:lease"

    @property
    def job_bytes(self) -> str:
        return f"{self.ns}:jobs:bytes"

    def live(self, response_id: str) -> str:
        return f"{self.ns}:live:{response_id}"

    # streamed retrieval
    def events(self, response_id: str) -> str:
        return f"{self.ns}:ev:{response_id}"

    @property
    def finished_events(self) -> str:
        return f"{self.ns}:ev:finished"

    # cancel across replicas
    def cancel_channel(self, replica: str) -> str:
        return f"{self.ns}:cancel:{replica}"

    def reply(self, token: str) -> str:
        return f"{self.ns}:reply:{token}"

    # the maintenance switch (hosted mode)
    @property
    def maintenance(self) -> str:
        return f"{self.ns}:maintenance"


class RedisContext:
    """What every Redis store of one replica shares: the two clients, the key names, the
    replica's id (which owns its jobs and receives their cancels) and the registered scripts."""

    def __init__(self, url: str, namespace: str, replica: str) -> None:
        self.redis = connect(url)
        self.blocking = connect(url, blocking=True)
        self.keys = Keys(namespace)
        self.replica = replica
        self._scripts: dict[str, Any] = {}

    def script(self, text: str) -> Any:
        """A registered script (EVALSHA, loaded again by redis-py after a Redis restart)."""
        script = self._scripts.get(text)
        if script is None:
            script = self._scripts[text] = self.redis.register_script(text)
        return script

    async def run(self, text: str, *args: Any) -> Any:
        return await self.script(text)(keys=[], args=list(args))

    async def close(self) -> None:
        await self.redis.aclose()
        await self.blocking.aclose()
