"""The current shape of the accounts tables, as the queries see them.

Migrations (migrations.py) create and evolve these tables; this module only describes the latest
version so that queries can be written with SQLAlchemy Core. A test checks that a freshly migrated
database has exactly these columns, so the two cannot drift apart silently.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import BigInteger, Boolean, Column, DateTime, ForeignKey, Integer, MetaData, String, Table, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

metadata = MetaData()


class UtcDateTime(TypeDecorator[datetime]):
    """A timestamp stored as naive UTC and read back as aware UTC.

    SQLite keeps no time zone and asyncpg returns aware values for TIMESTAMPTZ only; storing naive
    UTC everywhere gives both backends the same behaviour.
    """

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware")
        return value.astimezone(timezone.utc).replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=timezone.utc)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


organizations = Table(
    "organizations",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("credits_nanousd", BigInteger, nullable=False),
    Column("concurrency_limit", Integer, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("org_id", Integer, ForeignKey("organizations.id"), nullable=False, index=True),
    Column("prefix", String(32), nullable=False, unique=True),
    Column("key_hash", String(64), nullable=False, unique=True),
    # JSON array of model ids, or NULL for "every model in the catalog".
    Column("allowed_models", Text, nullable=True),
    Column("revoked", Boolean, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
)

usage_events = Table(
    "usage_events",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("generation_id", String(64), nullable=False, unique=True),
    Column("org_id", Integer, ForeignKey("organizations.id"), nullable=False),
    Column("key_prefix", String(32), nullable=False),
    Column("model", String(200), nullable=False),
    Column("input_tokens", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False),
    Column("output_tokens", Integer, nullable=False),
    Column("cost_nanousd", BigInteger, nullable=False),
    Column("status", String(16), nullable=False),
    Column("latency_ms", Integer, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
)
