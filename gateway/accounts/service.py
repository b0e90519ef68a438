"""The hosted mode's state in one object: database, authenticator, meter, limiter, catalog, maintenance.

``create_app`` builds one ``Accounts`` when ``--auth keys`` is on, opens it in the lifespan and hands
it to ``AccountsMiddleware`` (the request path) and the hosted routes (http/routes/usage.py). Nothing here
speaks HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy.exc import OperationalError

from .auth import Authenticator
from .catalog import Catalog
from .db import Database
from .limits import ConcurrencyLimiter, InMemoryLimiter
from .maintenance import LocalSwitch, MaintenanceSwitch
from .metering import Meter, UsageEvent, UsageRecord

if TYPE_CHECKING:
    from ..settings import Settings

log = logging.getLogger("kiln.gateway.accounts")
T = TypeVar("T")


class _FreeCatalog(Catalog):
    """No --catalog: every model the workers serve is allowed and costs nothing (tokens are still
    metered)."""

    def __init__(self) -> None:
        super().__init__({})

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str)

    def cost(self, model: str, input_tokens: int, cached_tokens: int, output_tokens: int) -> Decimal:
        return Decimal(0)


class Accounts:
    """Everything the hosted request path needs, opened once per gateway process."""

    def __init__(
        self,
        database_url: str,
        *,
        catalog_path: str | None = None,
        redis_url: str | None = None,
        redis_namespace: str = "kiln",
        admin_token: str | None = None,
        auth_cache_ttl: float = 2.0,
        max_body_bytes: int = 32 << 20,
    ) -> None:
        self.database_url = database_url
        self.redis_url = redis_url
        self.redis_namespace = redis_namespace
        self.admin_token = admin_token or None
        self.auth_cache_ttl = auth_cache_ttl
        self.max_body_bytes = max_body_bytes
        # Loaded now, not in the lifespan, so that a malformed catalog stops the CLI before it binds.
        self.catalog: Catalog | None = Catalog.load(catalog_path) if catalog_path else None
        # One process's switch until open(); shared through Redis when there is one.
        self.maintenance: MaintenanceSwitch = LocalSwitch()
        self.db: Database | None = None
        self.auth: Authenticator | None = None
        self.meter: Meter | None = None
        self.limiter: ConcurrencyLimiter | None = None
        self._write_lock: asyncio.Lock | None = None
        # A pending (reserved, unsettled) ledger row older than this is a request whose gateway
        # died: it is refunded. Longer than any request may run.
        self.pending_ttl_s = 3600.0
        self._expiry: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Accounts:
        if not settings.database_url:
            raise ValueError("--auth keys needs --database-url (env KILN_DATABASE_URL)")
        if getattr(settings, "store_mode", "none") != "none":
            log.info("--auth keys with the response store on: stored responses are kept per organization, within one budget for all; the hosted contract runs with --store none")
        return cls(
            settings.database_url,
            catalog_path=settings.catalog_path,
            redis_url=settings.redis_url,
            redis_namespace=settings.redis_namespace,
            admin_token=settings.admin_token,
            auth_cache_ttl=settings.auth_cache_ttl,
            max_body_bytes=settings.max_body_bytes,
        )

    async def open(self) -> None:
        self.db = await Database.open(self.database_url)
        self.auth = Authenticator(self.db, cache_ttl=self.auth_cache_ttl)
        self.meter = Meter(self.db, self.catalog if self.catalog is not None else _FreeCatalog())
        self._write_lock = asyncio.Lock() if self.db.dialect == "sqlite" else None
        if self.redis_url:
            from ..store.redis.connection import Keys, connect
            from .limits_redis import RedisLimiter
            from .maintenance import RedisSwitch

            self.limiter = RedisLimiter.from_url(self.redis_url, namespace=self.redis_namespace)
            self.maintenance = RedisSwitch(connect(self.redis_url), Keys(self.redis_namespace).maintenance)
        else:
            self.limiter = InMemoryLimiter()
        self._expiry = asyncio.create_task(self._expire_pending_loop(), name="kiln-expire-pending")
        log.info(
            "hosted accounts ready",
            extra={
                "database": self.db.dialect,
                "catalog": self.catalog.models() if self.catalog is not None else None,
                "limiter": "redis" if self.redis_url else "memory",
            },
        )

    async def record(self, record: UsageRecord) -> UsageEvent:
        """Write one usage event (and its debit) without a reservation."""
        assert self.meter is not None
        return await self._write(lambda meter: meter.record(record), record.generation_id)

    async def reserve(self, pending: UsageRecord, reserve_nanos: int) -> bool:
        """Debit a request's worst case and write its pending row, while the balance is above zero."""
        return await self._write(lambda meter: meter.reserve(pending, reserve_nanos), pending.generation_id)

    async def top_up(self, generation_id: str, org_id: int, extra_nanos: int, reserved_nanos: int = 0) -> bool:
        """Reserve ``extra_nanos`` more for a pending request that holds ``reserved_nanos``, while
        the balance without that reservation is above zero (Meter.top_up)."""
        return await self._write(lambda meter: meter.top_up(generation_id, org_id, extra_nanos, reserved_nanos), generation_id)

    async def settle(self, record: UsageRecord, reserved_nanos: int) -> UsageEvent:
        """Turn a request's pending row into its final one and refund the unused reservation."""
        return await self._write(lambda meter: meter.settle(record, reserved_nanos), record.generation_id)

    async def _write(self, action: Callable[[Meter], Awaitable[T]], generation_id: str, *, attempts: int = 6) -> T:
        """Run one ledger transaction, retrying a busy database.

        On SQLite the writes of this process go one at a time: concurrent deferred transactions in
        WAL mode can fail at once with "database is locked" (the busy timeout does not apply when a
        read snapshot must be upgraded). A retry is safe: the failed transaction rolled back, and
        every ledger write is idempotent per generation id."""
        assert self.meter is not None
        delay = 0.02
        for attempt in range(attempts):
            try:
                if self._write_lock is None:
                    return await action(self.meter)
                async with self._write_lock:
                    return await action(self.meter)
            except OperationalError:
                if attempt == attempts - 1:
                    raise
                log.warning("usage write failed; retrying", extra={"generation_id": generation_id, "attempt": attempt + 1})
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def _expire_pending_loop(self) -> None:
        """Refund reservations whose gateway died before settling them (any replica may do it)."""
        assert self.meter is not None
        while True:
            try:
                older_than = datetime.now(timezone.utc) - timedelta(seconds=self.pending_ttl_s)
                closed = await self._write(lambda meter: meter.expire_pending(older_than), "expire-pending")  # noqa: B023 (awaited in this iteration)
                if closed:
                    log.warning("refunded reservations of requests that never settled", extra={"rows": closed})
            except Exception:
                log.exception("could not expire pending usage rows")
            await asyncio.sleep(min(300.0, max(1.0, self.pending_ttl_s / 4)))

    async def close(self) -> None:
        task, self._expiry = self._expiry, None
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif task is not None and not task.get_loop().is_closed():
            task.get_loop().call_soon_threadsafe(task.cancel)  # opened on another loop (tests)
        if self.limiter is not None:
            await self.limiter.close()
        await self.maintenance.close()
        if self.db is not None:
            await self.db.close()
