"""Organizations: who pays, how much credit is left, how many requests may run at once."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Row
from sqlalchemy.exc import IntegrityError

from .db import Database
from .exceptions import AlreadyExists, NotFound
from .money import nanos_to_usd, usd_to_nanos
from .schema import organizations, utcnow

DEFAULT_CONCURRENCY_LIMIT = 8


@dataclass(frozen=True)
class Organization:
    id: int
    name: str
    credits_usd: Decimal
    concurrency_limit: int
    created_at: datetime


def _from_row(row: Row[Any]) -> Organization:
    return Organization(
        id=row.id,
        name=row.name,
        credits_usd=nanos_to_usd(row.credits_nanousd),
        concurrency_limit=row.concurrency_limit,
        created_at=row.created_at,
    )


async def create_org(db: Database, name: str, *, credits_usd: Decimal | int | str, concurrency_limit: int = DEFAULT_CONCURRENCY_LIMIT) -> Organization:
    name = name.strip()
    if not name:
        raise ValueError("organization name must not be empty")
    if concurrency_limit < 1:
        raise ValueError("concurrency limit must be at least 1")
    try:
        async with db.engine.begin() as conn:
            await conn.execute(
                organizations.insert().values(
                    name=name,
                    credits_nanousd=usd_to_nanos(credits_usd),
                    concurrency_limit=concurrency_limit,
                    created_at=utcnow(),
                )
            )
    except IntegrityError as exc:
        raise AlreadyExists(f"organization {name!r} already exists") from exc
    return await get_org(db, name)


async def get_org(db: Database, name: str) -> Organization:
    async with db.engine.connect() as conn:
        row = (await conn.execute(select(organizations).where(organizations.c.name == name))).first()
    if row is None:
        raise NotFound(f"no organization named {name!r}")
    return _from_row(row)


async def list_orgs(db: Database) -> list[Organization]:
    async with db.engine.connect() as conn:
        rows = (await conn.execute(select(organizations).order_by(organizations.c.name))).all()
    return [_from_row(row) for row in rows]


async def credit_org(db: Database, name: str, amount_usd: Decimal | int | str) -> Organization:
    """Add (or, with a negative amount, remove) credits in one atomic UPDATE."""
    async with db.engine.begin() as conn:
        result = await conn.execute(
            organizations.update()
            .where(organizations.c.name == name)
            .values(credits_nanousd=organizations.c.credits_nanousd + usd_to_nanos(amount_usd))
        )
        if result.rowcount == 0:
            raise NotFound(f"no organization named {name!r}")
    return await get_org(db, name)
