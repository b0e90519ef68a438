"""Accounts against real databases: SQLite (a temp file) and PostgreSQL (loopback, own schema)."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from decimal import Decimal

import pytest
from sqlalchemy import inspect, text

from kiln.gateway.accounts.auth import Authenticator
from kiln.gateway.accounts.catalog import Catalog
from kiln.gateway.accounts.db import Database, async_url, create_engine
from kiln.gateway.accounts.exceptions import AlreadyExists, NotFound
from kiln.gateway.accounts.keys import create_key, list_keys, revoke_key
from kiln.gateway.accounts.metering import Meter, UsageRecord, new_generation_id
from kiln.gateway.accounts.migrations import MIGRATIONS, migrate
from kiln.gateway.accounts.orgs import create_org, credit_org, get_org, list_orgs
from kiln.gateway.accounts.schema import metadata
from kiln.gateway.http.errors import ApiError

POSTGRES_URL = os.environ.get("KILN_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")

CATALOG = Catalog.loads(
    """
[models."m-big"]
input = "2.00"
cached_input = "0.50"
output = "8.00"

[models."m-small"]
input = 0.10
output = 0.40
"""
)


async def _postgres_schema() -> str:
    """A fresh schema on the test PostgreSQL, or skip when there is none."""
    schema = "kiln_test_" + secrets.token_hex(6)
    engine = create_engine(POSTGRES_URL)

    async def create() -> None:
        async with engine.begin() as conn:
            await conn.execute(text(f'CREATE SCHEMA "{schema}"'))

    try:
        await asyncio.wait_for(create(), 5)
    except Exception as exc:  # unreachable, no such database, timed out, ...
        pytest.skip(f"PostgreSQL unavailable at {POSTGRES_URL}: {exc}")
    finally:
        await engine.dispose()
    return schema


async def _drop_schema(schema: str) -> None:
    engine = create_engine(POSTGRES_URL)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    finally:
        await engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
async def db(request, tmp_path):
    if request.param == "sqlite":
        database = await Database.open(f"sqlite:///{tmp_path}/kiln.db")
        yield database
        await database.close()
        return
    schema = await _postgres_schema()
    database = await Database.open(POSTGRES_URL, schema=schema)
    try:
        yield database
    finally:
        await database.close()
        await _drop_schema(schema)


def bearer(key: str) -> str:
    return f"Bearer {key}"


# --- URLs and migrations ---------------------------------------------------------------------


def test_plain_urls_map_to_async_drivers():
    assert async_url("sqlite:///kiln.db") == "sqlite+aiosqlite:///kiln.db"
    assert async_url("sqlite:////var/lib/kiln.db") == "sqlite+aiosqlite:////var/lib/kiln.db"
    assert async_url("postgresql://u@h:5432/d") == "postgresql+asyncpg://u@h:5432/d"
    assert async_url("postgres://u@h/d") == "postgresql+asyncpg://u@h/d"
    with pytest.raises(ValueError):
        async_url("mysql://u@h/d")


async def test_migrations_are_recorded_once_and_match_schema(db):
    async with db.engine.connect() as conn:
        versions = (await conn.execute(text("SELECT version FROM kiln_schema_migrations"))).scalars()
        assert sorted(versions) == [m.version for m in MIGRATIONS]

        def columns(sync_conn):
            insp = inspect(sync_conn)
            return {t: {c["name"] for c in insp.get_columns(t)} for t in metadata.tables}

        found = await conn.run_sync(columns)
    assert found == {name: set(t.columns.keys()) for name, t in metadata.tables.items()}
    assert await migrate(db.engine) == []  # a second start applies nothing


# --- organizations and keys ------------------------------------------------------------------


async def test_org_lifecycle(db):
    org = await create_org(db, "acme", credits_usd="12.345678901")
    assert org.credits_usd == Decimal("12.345678901")
    assert org.concurrency_limit == 8
    with pytest.raises(AlreadyExists):
        await create_org(db, "acme", credits_usd=1)
    assert (await credit_org(db, "acme", Decimal("0.654321099"))).credits_usd == Decimal(13)
    with pytest.raises(NotFound):
        await credit_org(db, "nobody", 1)
    await create_org(db, "beta", credits_usd=0, concurrency_limit=2)
    assert [o.name for o in await list_orgs(db)] == ["acme", "beta"]


async def test_keys_are_hashed_and_listed_by_prefix(db):
    await create_org(db, "acme", credits_usd=1)
    new = await create_key(db, "acme", models=["m-big"])
    assert new.key.startswith(new.info.prefix) and new.info.prefix.startswith("sk-kiln-")
    async with db.engine.connect() as conn:
        stored = (await conn.execute(text("SELECT key_hash, prefix FROM api_keys"))).all()
    assert all(new.key not in row.key_hash for row in stored)
    [listed] = await list_keys(db, "acme")
    assert listed.prefix == new.info.prefix and listed.allowed_models == ("m-big",)
    with pytest.raises(NotFound):
        await create_key(db, "nobody")


# --- authentication --------------------------------------------------------------------------


async def test_authenticate_success_and_401s(db):
    await create_org(db, "acme", credits_usd=5, concurrency_limit=3)
    new = await create_key(db, "acme")
    auth = Authenticator(db, cache_ttl=0)
    principal = await auth.authenticate(bearer(new.key), "m-big")
    assert (principal.org_name, principal.key_prefix, principal.concurrency_limit) == (
        "acme", new.info.prefix, 3,
    )
    for header in (None, "", "Bearer", "Basic abc", bearer("sk-kiln-unknown")):
        with pytest.raises(ApiError) as err:
            await auth.authenticate(header, "m-big")
        assert err.value.status == 401 and err.value.code == "invalid_api_key"
        assert err.value.body()["error"]["type"] == "authentication_error"


async def test_revocation_takes_effect_within_cache_ttl(db):
    await create_org(db, "acme", credits_usd=5)
    new = await create_key(db, "acme")
    auth = Authenticator(db, cache_ttl=0.2)
    await auth.authenticate(bearer(new.key), None)
    await revoke_key(db, new.info.prefix)
    await asyncio.sleep(0.25)
    with pytest.raises(ApiError) as err:
        await auth.authenticate(bearer(new.key), None)
    assert err.value.status == 401 and err.value.code == "invalid_api_key"
    assert (await list_keys(db, "acme"))[0].revoked
    with pytest.raises(NotFound):
        await revoke_key(db, "sk-kiln-zzzzzzzz")


async def test_model_not_allowed_is_403(db):
    await create_org(db, "acme", credits_usd=5)
    new = await create_key(db, "acme", models=["m-small"])
    auth = Authenticator(db, cache_ttl=0)
    assert (await auth.authenticate(bearer(new.key), "m-small")).org_name == "acme"
    assert (await auth.authenticate(bearer(new.key), None)).org_name == "acme"
    with pytest.raises(ApiError) as err:
        await auth.authenticate(bearer(new.key), "m-big")
    assert err.value.status == 403 and err.value.param == "model"


async def test_exhausted_credits_are_402(db):
    await create_org(db, "broke", credits_usd=0)
    new = await create_key(db, "broke")
    auth = Authenticator(db, cache_ttl=0)
    with pytest.raises(ApiError) as err:
        await auth.authenticate(bearer(new.key), "m-big")
    assert err.value.status == 402 and err.value.code == "insufficient_quota"
    # Reading one's own usage stays possible with no credit left.
    assert (await auth.authenticate(bearer(new.key), None, require_credits=False)).org_name == "broke"
    await credit_org(db, "broke", "0.000000001")
    assert (await auth.authenticate(bearer(new.key), "m-big")).org_name == "broke"


# --- metering --------------------------------------------------------------------------------


def _record(org_id: int, model: str = "m-big", status: str = "completed", **tokens) -> UsageRecord:
    return UsageRecord(
        generation_id=new_generation_id(),
        org_id=org_id,
        key_prefix="sk-kiln-test0000",
        model=model,
        status=status,
        input_tokens=tokens.get("input", 1000),
        cached_tokens=tokens.get("cached", 0),
        output_tokens=tokens.get("output", 100),
        latency_ms=42,
    )


async def test_record_debits_cost_and_ledger_sums_match(db):
    org = await create_org(db, "acme", credits_usd=10)
    meter = Meter(db, CATALOG)
    records = [
        _record(org.id, input=1000, cached=400, output=100),  # 600*2 + 400*0.5 + 100*8 = 2200 /1e6
        _record(org.id, model="m-small", status="incomplete", input=9, output=12),
        _record(org.id, status="failed", input=5000, output=5000),
        _record(org.id, status="error"),
    ]
    events = await asyncio.gather(*(meter.record(r) for r in records))
    assert events[0].cost_usd == Decimal("0.0022")
    assert events[1].cost_usd == Decimal("0.0000057")  # 9*0.10 + 12*0.40 = 5.7 per 1e6
    assert events[2].cost_usd == 0 and events[3].cost_usd == 0
    totals = await meter.totals(org.id)
    assert totals.events == 4
    assert totals.input_tokens == sum(r.input_tokens for r in records)
    assert totals.output_tokens == sum(r.output_tokens for r in records)
    assert totals.cost_usd == sum(e.cost_usd for e in events)
    assert (await get_org(db, "acme")).credits_usd == Decimal(10) - totals.cost_usd


async def test_record_is_idempotent_per_generation_id(db):
    org = await create_org(db, "acme", credits_usd=1)
    meter = Meter(db, CATALOG)
    record = _record(org.id)
    first = await meter.record(record)
    again = await meter.record(record)
    assert again.cost_usd == first.cost_usd
    assert (await meter.totals(org.id)).events == 1
    assert (await get_org(db, "acme")).credits_usd == Decimal(1) - first.cost_usd


async def test_concurrent_debits_do_not_lose_updates(db):
    org = await create_org(db, "acme", credits_usd=1)
    meter = Meter(db, CATALOG)
    await asyncio.gather(*(meter.record(_record(org.id, input=1000, output=0)) for _ in range(20)))
    assert (await get_org(db, "acme")).credits_usd == Decimal(1) - 20 * Decimal("0.002")


async def test_list_usage_pages_filters_and_isolates(db):
    a = await create_org(db, "a", credits_usd=10)
    b = await create_org(db, "b", credits_usd=10)
    meter = Meter(db, CATALOG)
    mine = [await meter.record(_record(a.id, model="m-big" if i % 2 else "m-small")) for i in range(5)]
    theirs = await meter.record(_record(b.id))

    first = await meter.list_usage(a.id, limit=2)
    assert [e.generation_id for e in first.data] == [e.generation_id for e in mine[:2]]
    assert first.has_more
    seen = list(first.data)
    page = first
    while page.has_more:
        page = await meter.list_usage(a.id, limit=2, after_id=page.data[-1].generation_id)
        seen += page.data
    assert [e.generation_id for e in seen] == [e.generation_id for e in mine]
    assert all(e.org_id == a.id for e in seen)

    big = await meter.list_usage(a.id, model="m-big")
    assert {e.model for e in big.data} == {"m-big"} and len(big.data) == 2
    assert (await meter.list_usage(b.id)).data == [theirs]
    with pytest.raises(ApiError) as err:  # another org's cursor is unknown here
        await meter.list_usage(a.id, after_id=theirs.generation_id)
    assert err.value.status == 400
    assert (await meter.list_usage(a.id, after_ts=time.time() + 60)).data == []
    assert len((await meter.list_usage(a.id, before_ts=time.time() + 60)).data) == 5
    body = first.to_json()
    assert body["object"] == "list" and body["last_id"] == mine[1].generation_id
    with pytest.raises(ApiError):
        await meter.list_usage(a.id, limit=0)
