"""The ledger summed over time: requests, tokens and cost per time bucket, organization and model.

The operator console draws its usage plot from this (``GET /admin/usage``). The sums are done by the
database (one grouped query over the window, never the rows one by one in Python), and both the
buckets and the points are bounded, so a long window over a large ledger stays one bounded answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, Integer, and_, case, cast, func, select

from .db import Database
from .metering import PENDING, UNBILLED_STATUSES
from .money import nanos_to_usd
from .schema import organizations, usage_events

MAX_BUCKETS = 500
MAX_POINTS = 20_000


@dataclass(frozen=True)
class UsagePoint:
    """One bucket of one organization's use of one model."""

    start: int  # the bucket's first second, unix time
    org: str
    model: str
    requests: int  # settled ledger rows (pending reservations are not counted yet)
    errors: int  # rows of failed or refused generations (billed nothing)
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "org": self.org,
            "model": self.model,
            "requests": self.requests,
            "errors": self.errors,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": str(self.cost_usd),
        }


def _epoch(db: Database, column):  # type: ignore[no-untyped-def]
    """Unix seconds of a stored timestamp (naive UTC on both backends, schema.UtcDateTime)."""
    if db.dialect == "sqlite":
        return cast(func.strftime("%s", column), Integer)
    return cast(func.floor(func.extract("epoch", column)), BigInteger)


async def usage_series(db: Database, *, start: int, end: int, bucket_s: int) -> tuple[list[UsagePoint], bool]:
    """The points of [start, end) in buckets of ``bucket_s`` seconds, oldest first, and whether the
    answer was cut at ``MAX_POINTS``. ``ValueError`` for a window of more than ``MAX_BUCKETS``."""
    if bucket_s < 1 or end <= start:
        raise ValueError("the window must be non-empty and the bucket at least one second")
    if (end - start + bucket_s - 1) // bucket_s > MAX_BUCKETS:
        raise ValueError(f"at most {MAX_BUCKETS} buckets: widen the bucket or narrow the window")
    stamp = usage_events.c.created_at
    offset = (_epoch(db, stamp) - start) // bucket_s  # floor division on both backends (/ is true division)
    bucket = (offset * bucket_s + start).label("bucket")
    errors = func.sum(case((usage_events.c.status.in_(sorted(UNBILLED_STATUSES)), 1), else_=0))
    query = (
        select(
            bucket,
            organizations.c.name,
            usage_events.c.model,
            func.count(),
            errors,
            func.coalesce(func.sum(usage_events.c.input_tokens), 0),
            func.coalesce(func.sum(usage_events.c.output_tokens), 0),
            func.coalesce(func.sum(usage_events.c.cost_nanousd), 0),
        )
        .join(organizations, organizations.c.id == usage_events.c.org_id)
        .where(
            and_(
                stamp >= datetime.fromtimestamp(start, timezone.utc),
                stamp < datetime.fromtimestamp(end, timezone.utc),
                usage_events.c.status != PENDING,
            )
        )
        .group_by(bucket, organizations.c.name, usage_events.c.model)
        .order_by(bucket, organizations.c.name, usage_events.c.model)
        .limit(MAX_POINTS + 1)
    )
    async with db.engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    points = [
        UsagePoint(int(b), str(org), str(model), int(n), int(err or 0), int(inp), int(out), nanos_to_usd(int(cost)))
        for b, org, model, n, err, inp, out, cost in rows[:MAX_POINTS]
    ]
    return points, len(rows) > MAX_POINTS
