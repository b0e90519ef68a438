"""Opening the accounts database.

Operators write plain URLs (``sqlite:///kiln.db``, ``postgresql://user@host/db``); this module maps
them to SQLAlchemy's async drivers (aiosqlite, asyncpg) so that nobody has to know driver names, and
applies pending migrations when the database is opened.
"""

from __future__ import annotations

import os
import re
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from .migrations import migrate

DEFAULT_DATABASE_URL = "sqlite:///kiln.db"

_ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
    "postgres": "postgresql+asyncpg",
    "postgresql": "postgresql+asyncpg",
    "postgresql+asyncpg": "postgresql+asyncpg",
}
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def async_url(url: str) -> str:
    """Map ``sqlite:///PATH`` and ``postgresql://...`` to their async-driver forms."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _ASYNC_DRIVERS:
        raise ValueError(f"unsupported database URL {url!r}: use sqlite:///PATH or postgresql://USER@HOST/DB")
    return f"{_ASYNC_DRIVERS[scheme]}://{rest}"


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:  # the DB-API connection: untyped
    # WAL lets the CLI write while the gateway reads; busy_timeout makes concurrent writers wait
    # instead of failing; SQLite enforces foreign keys only when asked.
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()


def _private_sqlite_file(path: str | None) -> None:
    """Create the SQLite file owner-only (0600) before SQLite does (it would honour the umask,
    typically 0644: API key hashes and every tenant's ledger readable by any local user).

    SQLite gives the -wal and -shm files the database file's mode; existing ones are tightened too.
    """
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    for name in (path, path + "-wal", path + "-shm"):
        try:
            if os.stat(name).st_mode & 0o077:
                os.chmod(name, 0o600)
        except FileNotFoundError:
            pass
        except PermissionError:  # not ours to change (e.g. a read-only deployment); leave it
            pass


def create_engine(url: str, *, schema: str | None = None) -> AsyncEngine:
    """An async engine for a plain URL; ``schema`` sets PostgreSQL's search_path (tests, tenancy)."""
    target = make_url(async_url(url))
    connect_args: dict[str, Any] = {}
    if schema is not None:
        if target.get_backend_name() != "postgresql":
            raise ValueError("a schema can only be chosen on PostgreSQL")
        if not _SCHEMA_NAME.match(schema):
            raise ValueError(f"invalid schema name {schema!r}")
        connect_args["server_settings"] = {"search_path": schema}
    engine = create_async_engine(target, connect_args=connect_args, pool_pre_ping=True)
    if target.get_backend_name() == "sqlite":
        _private_sqlite_file(target.database)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


class Database:
    """The accounts database: an async engine whose schema is migrated to the latest version."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @classmethod
    async def open(cls, url: str, *, schema: str | None = None, run_migrations: bool = True) -> Database:
        engine = create_engine(url, schema=schema)
        try:
            if run_migrations:
                await migrate(engine)
        except BaseException:
            await engine.dispose()
            raise
        return cls(engine)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    async def close(self) -> None:
        await self.engine.dispose()
