"""The usage ledger: one row per generation, and the credit debit that goes with it.

The gateway mints a generation id before it sends anything (it goes in the
``X-Neocloud-Generation-Id`` header, also on streams), then calls ``Meter.record`` once the final
event or error is known. Writing the event and debiting the organization happen in one transaction,
so the ledger and the balance can never disagree. ``completed``, ``incomplete`` and ``cancelled``
generations are billed (a stream cut by its client or cancelled by it is billed for what it
delivered); ``failed`` and ``error`` ones are recorded with cost 0. Recording is idempotent per
generation id: a retried call neither duplicates the row nor debits twice.

Admission reserves before a worker is involved (``reserve``): one transaction debits the request's
worst-case cost, only while the balance is above zero, and writes a ``pending`` row carrying the
reservation as its cost. ``settle`` turns that row into the final one and gives back what the
reservation over-took, again in one transaction. So the balance is checked live (no cache), N
concurrent requests can overdraw by at most the last one's reservation, and the ledger still sums
to what was debited at every instant. A pending row whose gateway died is refunded by
``expire_pending`` (status ``expired``) once it is an hour old; should its request still settle
after that, the row becomes final and its cost is debited then.
"""

from __future__ import annotations

import logging
import secrets
import string
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.engine import Row
from sqlalchemy.exc import IntegrityError

from kiln.gateway.http.errors import ApiError

from .catalog import Catalog
from .db import Database
from .money import nanos_to_usd, usd_to_nanos
from .schema import organizations, usage_events, utcnow

log = logging.getLogger(__name__)

BILLED_STATUSES = frozenset({"completed", "incomplete", "cancelled"})
UNBILLED_STATUSES = frozenset({"failed", "error"})
PENDING = "pending"
# A pending row refunded by ``expire_pending``; if its request does settle later after all, the
# row becomes final and the request's cost is debited then.
EXPIRED = "expired"
MAX_PAGE = 1000
_ID_ALPHABET = string.ascii_letters + string.digits


def new_generation_id() -> str:
    """``gen_`` + 24 random alphanumerics (~143 bits): unique without asking the database."""
    return "gen_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class UsageRecord:
    """What the gateway knows when a generation ends."""

    generation_id: str
    org_id: int
    key_prefix: str
    model: str
    status: str
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    latency_ms: int = 0


@dataclass(frozen=True)
class UsageEvent:
    """One ledger row, cost included (what was debited, in USD)."""

    generation_id: str
    org_id: int
    key_prefix: str
    model: str
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost_usd: Decimal
    status: str
    latency_ms: int
    created_at: datetime

    def to_json(self) -> dict[str, Any]:
        """The event as GET /v1/usage shows it."""
        return {
            "object": "usage.event",
            "id": self.generation_id,
            "created_at": int(self.created_at.timestamp()),
            "model": self.model,
            "status": self.status,
            "key_prefix": self.key_prefix,
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "total_tokens": self.input_tokens + self.output_tokens,
            "cost": float(self.cost_usd),
            "latency_ms": self.latency_ms,
        }


@dataclass(frozen=True)
class UsagePage:
    data: list[UsageEvent]
    has_more: bool

    def to_json(self) -> dict[str, Any]:
        """An OpenAI-style list; ``last_id`` is the ``after`` cursor of the next page."""
        return {
            "object": "list",
            "data": [event.to_json() for event in self.data],
            "first_id": self.data[0].generation_id if self.data else None,
            "last_id": self.data[-1].generation_id if self.data else None,
            "has_more": self.has_more,
        }


@dataclass(frozen=True)
class UsageTotals:
    events: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost_usd: Decimal


def _event(row: Row[Any]) -> UsageEvent:
    return UsageEvent(
        generation_id=row.generation_id,
        org_id=row.org_id,
        key_prefix=row.key_prefix,
        model=row.model,
        input_tokens=row.input_tokens,
        cached_tokens=row.cached_tokens,
        output_tokens=row.output_tokens,
        cost_usd=nanos_to_usd(row.cost_nanousd),
        status=row.status,
        latency_ms=row.latency_ms,
        created_at=row.created_at,
    )


def _credit(org_id: int, nanos: int, *when: Any) -> Any:
    """The update adding ``nanos`` (negative: a debit) to the organization's balance, if ``when``."""
    return organizations.update().where(organizations.c.id == org_id, *when).values(credits_nanousd=organizations.c.credits_nanousd + nanos)


def _check(record: UsageRecord) -> None:
    if record.status not in BILLED_STATUSES | UNBILLED_STATUSES:
        raise ValueError(f"unknown usage status {record.status!r}")
    if min(record.input_tokens, record.cached_tokens, record.output_tokens, record.latency_ms) < 0:
        raise ValueError("token counts and latency must not be negative")


def _as_datetime(ts: float | int | datetime) -> datetime:
    if isinstance(ts, datetime):
        return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)
    return datetime.fromtimestamp(ts, timezone.utc)


class Meter:
    """Records usage events against the catalog's prices and lists an organization's ledger."""

    def __init__(self, db: Database, catalog: Catalog) -> None:
        self._db = db
        self._catalog = catalog

    def cost_nanos(self, record: UsageRecord) -> int:
        """What the record is billed, in nano-dollars (0 for unbilled statuses)."""
        if record.status not in BILLED_STATUSES:
            return 0
        if record.model not in self._catalog:
            # The model left the catalog while the request ran: record it, but there is no price.
            log.warning("no price for model %r; generation %s recorded at cost 0", record.model, record.generation_id)
            return 0
        cost = self._catalog.cost(record.model, record.input_tokens, record.cached_tokens, record.output_tokens)
        return usd_to_nanos(cost)

    def price_nanos(self, model: str, input_tokens: int, output_tokens: int) -> int:
        """What ``input_tokens`` in and ``output_tokens`` out would cost, in nano-dollars."""
        if model not in self._catalog:
            return 0
        return usd_to_nanos(self._catalog.cost(model, input_tokens, 0, output_tokens))

    async def record(self, record: UsageRecord) -> UsageEvent:
        """Write the event and debit its cost in one transaction; return the ledger row."""
        _check(record)
        cost = self.cost_nanos(record)
        values: dict[str, Any] = dict(
            generation_id=record.generation_id,
            org_id=record.org_id,
            key_prefix=record.key_prefix,
            model=record.model,
            input_tokens=record.input_tokens,
            cached_tokens=min(record.cached_tokens, record.input_tokens),
            output_tokens=record.output_tokens,
            cost_nanousd=cost,
            status=record.status,
            latency_ms=int(record.latency_ms),
            created_at=utcnow(),
        )
        try:
            async with self._db.engine.begin() as conn:
                await conn.execute(usage_events.insert().values(**values))
                if cost:
                    await conn.execute(_credit(record.org_id, -cost))
        except IntegrityError:
            existing = await self.get(record.org_id, record.generation_id)
            if existing is None:  # not a duplicate: e.g. an unknown organization
                raise
            return existing
        del values["cost_nanousd"]
        return UsageEvent(**values, cost_usd=nanos_to_usd(cost))

    async def reserve(self, pending: UsageRecord, reserve_nanos: int) -> bool:
        """Debit ``reserve_nanos`` and write the pending row, if the organization's balance is above
        zero right now; False (nothing written) when it is not."""
        reserve_nanos = max(0, int(reserve_nanos))
        async with self._db.engine.begin() as conn:
            debit = await conn.execute(_credit(pending.org_id, -reserve_nanos, organizations.c.credits_nanousd > 0))
            if debit.rowcount != 1:
                return False
            await conn.execute(
                usage_events.insert().values(
                    generation_id=pending.generation_id,
                    org_id=pending.org_id,
                    key_prefix=pending.key_prefix,
                    model=pending.model,
                    input_tokens=0,
                    cached_tokens=0,
                    output_tokens=0,
                    cost_nanousd=reserve_nanos,
                    status=PENDING,
                    latency_ms=0,
                    created_at=utcnow(),
                )
            )
        return True

    async def top_up(self, generation_id: str, org_id: int, extra_nanos: int, reserved_nanos: int = 0) -> bool:
        """Debit ``extra_nanos`` more for a pending request (its worst case grew once its history
        was expanded) and add it to its row, if the balance without the request's own reservation
        (``reserved_nanos``) is above zero right now: the same rule admission applied to that
        reservation, so the requests admitted together while the balance was positive (the last of
        which may have taken it below zero) are not refused for growing; False (nothing written)
        when it is not, or when the row is no longer pending."""
        extra_nanos = max(0, int(extra_nanos))
        async with self._db.engine.begin() as conn:
            debit = await conn.execute(_credit(org_id, -extra_nanos, organizations.c.credits_nanousd + int(reserved_nanos) > 0))
            if debit.rowcount != 1:
                return False
            row = await conn.execute(
                usage_events.update()
                .where(usage_events.c.generation_id == generation_id, usage_events.c.status == PENDING)
                .values(cost_nanousd=usage_events.c.cost_nanousd + extra_nanos)
            )
            if row.rowcount != 1:
                await conn.rollback()
                return False
        return True

    async def settle(self, record: UsageRecord, reserved_nanos: int) -> UsageEvent:
        """Replace the pending row of ``record.generation_id`` by the final one and refund
        ``reserved_nanos - cost``; idempotent (a settled row is returned as it is)."""
        _check(record)
        cost = self.cost_nanos(record)
        final = dict(
            status=record.status,
            input_tokens=record.input_tokens,
            cached_tokens=min(record.cached_tokens, record.input_tokens),
            output_tokens=record.output_tokens,
            cost_nanousd=cost,
            latency_ms=int(record.latency_ms),
        )
        row = usage_events.c.generation_id == record.generation_id
        async with self._db.engine.begin() as conn:
            refund = int(reserved_nanos) - cost
            updated = await conn.execute(usage_events.update().where(row, usage_events.c.status == PENDING).values(**final))
            if updated.rowcount != 1:
                # Expired while it ran (its reservation was already given back): debit the cost now.
                updated = await conn.execute(usage_events.update().where(row, usage_events.c.status == EXPIRED).values(**final))
                refund = -cost
            if updated.rowcount == 1 and refund:
                await conn.execute(_credit(record.org_id, refund))
        event = await self.get(record.org_id, record.generation_id)
        if event is None:
            raise LookupError(f"no ledger row for {record.generation_id}")
        return event

    async def expire_pending(self, older_than: datetime) -> int:
        """Refund pending rows created before ``older_than`` (status ``expired``, cost 0): their
        gateway died before settling them. Returns how many were closed."""
        async with self._db.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(usage_events.c.generation_id, usage_events.c.org_id, usage_events.c.cost_nanousd).where(
                        usage_events.c.status == PENDING, usage_events.c.created_at < _as_datetime(older_than)
                    )
                )
            ).all()
        closed = 0
        for row in rows:
            async with self._db.engine.begin() as conn:
                done = await conn.execute(
                    usage_events.update()
                    .where(usage_events.c.generation_id == row.generation_id, usage_events.c.status == PENDING)
                    .values(status=EXPIRED, cost_nanousd=0)
                )
                if done.rowcount == 1:
                    closed += 1
                    if row.cost_nanousd:
                        await conn.execute(_credit(row.org_id, row.cost_nanousd))
        return closed

    async def balance_nanos(self, org_id: int) -> int:
        """The organization's balance as the database has it now (admission reads it uncached)."""
        async with self._db.engine.connect() as conn:
            value = (await conn.execute(select(organizations.c.credits_nanousd).where(organizations.c.id == org_id))).scalar()
        return int(value or 0)

    async def get(self, org_id: int, generation_id: str) -> UsageEvent | None:
        query = select(usage_events).where(usage_events.c.org_id == org_id, usage_events.c.generation_id == generation_id)
        async with self._db.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return None if row is None else _event(row)

    async def list_usage(
        self,
        org_id: int,
        *,
        after_ts: float | int | datetime | None = None,
        before_ts: float | int | datetime | None = None,
        model: str | None = None,
        limit: int = 100,
        after_id: str | None = None,
    ) -> UsagePage:
        """One page of the organization's events, oldest first.

        ``after_ts``/``before_ts`` bound ``created_at`` as a half-open window [after_ts, before_ts)
        (unix seconds or aware datetimes). ``after_id`` is the ``last_id`` of the previous page; an
        id of another organization is as unknown as a made-up one (400, param ``after``).
        """
        if not 1 <= limit <= MAX_PAGE:
            raise ApiError(400, f"limit must be between 1 and {MAX_PAGE}", param="limit")
        conditions = [usage_events.c.org_id == org_id]
        if after_ts is not None:
            conditions.append(usage_events.c.created_at >= _as_datetime(after_ts))
        if before_ts is not None:
            conditions.append(usage_events.c.created_at < _as_datetime(before_ts))
        if model is not None:
            conditions.append(usage_events.c.model == model)
        async with self._db.engine.connect() as conn:
            if after_id is not None:
                cursor = (
                    await conn.execute(
                        select(usage_events.c.id).where(
                            usage_events.c.org_id == org_id,
                            usage_events.c.generation_id == after_id,
                        )
                    )
                ).scalar()
                if cursor is None:
                    raise ApiError(400, f"unknown cursor {after_id!r}", param="after")
                conditions.append(usage_events.c.id > cursor)
            query = select(usage_events).where(and_(*conditions)).order_by(usage_events.c.id).limit(limit + 1)
            rows = (await conn.execute(query)).all()
        return UsagePage(data=[_event(row) for row in rows[:limit]], has_more=len(rows) > limit)

    async def totals(self, org_id: int) -> UsageTotals:
        """Sums over the organization's ledger (for a console or a reconciliation check)."""
        zero = 0
        query = select(
            func.count(),
            func.coalesce(func.sum(usage_events.c.input_tokens), zero),
            func.coalesce(func.sum(usage_events.c.cached_tokens), zero),
            func.coalesce(func.sum(usage_events.c.output_tokens), zero),
            func.coalesce(func.sum(usage_events.c.cost_nanousd), zero),
        ).where(usage_events.c.org_id == org_id)
        async with self._db.engine.connect() as conn:
            count, inp, cached, out, cost = (await conn.execute(query)).one()
        return UsageTotals(int(count), int(inp), int(cached), int(out), nanos_to_usd(int(cost)))

