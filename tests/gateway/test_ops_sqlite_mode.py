"""The SQLite accounts file (key hashes, every tenant's ledger) is readable by its owner only."""

from __future__ import annotations

import asyncio
import os
import stat
from decimal import Decimal

from kiln.gateway.accounts.db import Database
from kiln.gateway.accounts.orgs import create_org, list_orgs


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_database_and_its_wal_files_are_0600(tmp_path):
    path = tmp_path / "kiln.db"
    old = os.umask(0o022)  # the usual umask, under which SQLite alone would create 0644
    try:
        async def go():
            db = await Database.open(f"sqlite:///{path}")
            try:
                await create_org(db, "acme", credits_usd=Decimal("1"))
                names = [p.name for p in tmp_path.iterdir()]
                return names, [_mode(tmp_path / n) for n in names]
            finally:
                await db.close()

        names, modes = asyncio.run(go())
    finally:
        os.umask(old)
    assert "kiln.db" in names and "kiln.db-wal" in names, names
    assert modes == [0o600] * len(names), dict(zip(names, map(oct, modes), strict=False))


def test_existing_world_readable_database_is_tightened(tmp_path):
    path = tmp_path / "kiln.db"

    async def create_then_list():
        db = await Database.open(f"sqlite:///{path}")
        try:
            await create_org(db, "acme", credits_usd=Decimal("1"))
        finally:
            await db.close()
        os.chmod(path, 0o644)
        db = await Database.open(f"sqlite:///{path}")
        try:
            return [o.name for o in await list_orgs(db)]
        finally:
            await db.close()

    assert asyncio.run(create_then_list()) == ["acme"]
    assert _mode(path) == 0o600
