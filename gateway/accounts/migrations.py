"""Versioned schema migrations, applied at startup.

Each migration is a frozen function of a sync SQLAlchemy connection: once released it never changes,
because databases in the field already ran it. Changing the schema means appending a migration here
and updating schema.py to match. Applied versions are rows of ``kiln_schema_migrations``. The whole
run is one transaction; on PostgreSQL an advisory lock keeps two gateway replicas that start at the
same moment from migrating twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import BigInteger, Boolean, Column, DateTime, ForeignKey, Index, Integer, MetaData, String, Table, Text, select
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

_ADVISORY_LOCK_KEY = 0x4B494C4E  # "KILN"

_versions = MetaData()
version_table = Table(
    "kiln_schema_migrations",
    _versions,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("name", String(200), nullable=False),
    Column("applied_at", DateTime, nullable=False),
)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    apply: Callable[[Connection], None]


def _v1_accounts(conn: Connection) -> None:
    """Organizations, API keys and the usage ledger (frozen snapshot of version 1)."""
    md = MetaData()
    Table(
        "organizations",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("name", String(200), nullable=False, unique=True),
        Column("credits_nanousd", BigInteger, nullable=False),
        Column("concurrency_limit", Integer, nullable=False),
        Column("created_at", DateTime, nullable=False),
    )
    Table(
        "api_keys",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("org_id", Integer, ForeignKey("organizations.id"), nullable=False, index=True),
        Column("prefix", String(32), nullable=False, unique=True),
        Column("key_hash", String(64), nullable=False, unique=True),
        Column("allowed_models", Text, nullable=True),
        Column("revoked", Boolean, nullable=False),
        Column("created_at", DateTime, nullable=False),
    )
    events = Table(
        "usage_events",
        md,
        Column(
            "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
        ),
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
        Column("created_at", DateTime, nullable=False),
    )
    # GET /v1/usage pages one organization's events in id order, optionally by time.
    Index("ix_usage_events_org_id_id", events.c.org_id, events.c.id)
    Index("ix_usage_events_org_id_created_at", events.c.org_id, events.c.created_at)
    md.create_all(conn)


MIGRATIONS: tuple[Migration, ...] = (Migration(1, "accounts", _v1_accounts),)


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer Kiln; running older code against it is unsafe."""


def _apply_pending(conn: Connection) -> list[int]:
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_ADVISORY_LOCK_KEY})")
    _versions.create_all(conn)
    applied = set(conn.execute(select(version_table.c.version)).scalars())
    latest = max(m.version for m in MIGRATIONS)
    if applied and max(applied) > latest:
        raise SchemaTooNew(f"database schema is at version {max(applied)}, this Kiln knows up to {latest}")
    done: list[int] = []
    for migration in sorted(MIGRATIONS, key=lambda m: m.version):
        if migration.version in applied:
            continue
        migration.apply(conn)
        conn.execute(version_table.insert().values(version=migration.version, name=migration.name, applied_at=datetime.now(timezone.utc).replace(tzinfo=None)))
        done.append(migration.version)
    return done


async def migrate(engine: AsyncEngine) -> list[int]:
    """Apply every pending migration in one transaction; return the versions applied now."""
    async with engine.begin() as conn:
        return await conn.run_sync(_apply_pending)
