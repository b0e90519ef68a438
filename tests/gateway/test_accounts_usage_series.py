"""The ledger summed per time bucket, organization and model (``GET /admin/usage``, the console's
usage plot), on SQLite and PostgreSQL: rows land in the bucket their time falls in, pending
reservations are left out, failed rows count as errors, and the window is bounded."""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal

import pytest

from kiln.gateway.accounts.money import usd_to_nanos
from kiln.gateway.accounts.orgs import create_org
from kiln.gateway.accounts.schema import usage_events
from kiln.gateway.accounts.usage_series import MAX_BUCKETS, usage_series
from tests.gateway.test_accounts_db import db  # noqa: F401  (the sqlite/postgresql fixture)

T0 = 1_767_225_600  # 2026-01-01T00:00:00Z, a minute boundary


async def _row(db, n: int, org_id: int, model: str, at: int, *, status: str = "completed", out: int = 10, cost: str = "0.001") -> None:  # noqa: F811
    async with db.engine.begin() as conn:
        await conn.execute(usage_events.insert().values(
            generation_id=f"gen_{n:024d}", org_id=org_id, key_prefix="sk-kiln-test0000", model=model,
            input_tokens=5, cached_tokens=0, output_tokens=out, cost_nanousd=usd_to_nanos(cost), status=status,
            latency_ms=100, created_at=datetime.fromtimestamp(at, timezone.utc),
        ))


async def test_rows_land_in_their_bucket(db):  # noqa: F811
    acme = await create_org(db, "acme", credits_usd="10")
    beta = await create_org(db, "beta", credits_usd="10")
    await _row(db, 1, acme.id, "m1", T0 + 5)
    await _row(db, 2, acme.id, "m1", T0 + 59)
    await _row(db, 3, acme.id, "m1", T0 + 60)  # the next minute
    await _row(db, 4, beta.id, "m2", T0 + 61, status="failed", out=0, cost="0")
    await _row(db, 5, beta.id, "m2", T0 + 62, status="pending")  # a reservation: not counted yet
    await _row(db, 6, acme.id, "m1", T0 + 180)  # outside [T0, T0 + 180)
    points, truncated = await usage_series(db, start=T0, end=T0 + 180, bucket_s=60)
    assert not truncated
    got = [(p.start, p.org, p.model, p.requests, p.errors, p.input_tokens, p.output_tokens, p.cost_usd) for p in points]
    assert got == [
        (T0, "acme", "m1", 2, 0, 10, 20, Decimal("0.002")),
        (T0 + 60, "acme", "m1", 1, 0, 5, 10, Decimal("0.001")),
        (T0 + 60, "beta", "m2", 1, 1, 5, 0, Decimal("0")),
    ]
    # Buckets are counted from the window's start, not from the epoch.
    shifted, _ = await usage_series(db, start=T0 + 30, end=T0 + 150, bucket_s=60)
    assert [(p.start, p.org, p.requests) for p in shifted] == [(T0 + 30, "acme", 2), (T0 + 30, "beta", 1)]


async def test_the_window_is_bounded(db):  # noqa: F811
    with pytest.raises(ValueError, match="buckets"):
        await usage_series(db, start=T0, end=T0 + 60 * (MAX_BUCKETS + 1), bucket_s=60)
    with pytest.raises(ValueError):
        await usage_series(db, start=T0, end=T0, bucket_s=60)
