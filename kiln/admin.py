"""Operator commands for the hosted gateway: ``kiln orgs ...`` and ``kiln keys ...``.

The ``orgs`` and ``keys`` groups are meant to be added to the ``kiln`` umbrella
(``main.add_command(orgs)``). Each command opens the accounts database (applying migrations),
does one thing and closes it. ``keys create`` prints the new key alone on the last line of stdout so
that scripts can take it with ``tail -n1``; it is shown only once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar

import click

from kiln.gateway.accounts.db import DEFAULT_DATABASE_URL, Database
from kiln.gateway.accounts.exceptions import AccountsError
from kiln.gateway.accounts.keys import create_key, list_keys, revoke_key
from kiln.gateway.accounts.orgs import (
    DEFAULT_CONCURRENCY_LIMIT,
    create_org,
    credit_org,
    list_orgs,
)

T = TypeVar("T")

database_url_option = click.option(
    "--database-url",
    envvar="KILN_DATABASE_URL",
    default=DEFAULT_DATABASE_URL,
    show_default=True,
    help="sqlite:///PATH or postgresql://USER@HOST/DB (env KILN_DATABASE_URL).",
)


class UsdAmount(click.ParamType):  # type: ignore[type-arg]  # generic in click's stubs only since 8.2
    """A USD amount read as an exact Decimal (never a float)."""

    name = "usd"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Decimal:
        if isinstance(value, Decimal):
            return value
        try:
            amount = Decimal(str(value).strip().lstrip("$"))
        except InvalidOperation:
            self.fail(f"{value!r} is not a USD amount", param, ctx)
        if not amount.is_finite():
            self.fail(f"{value!r} is not a USD amount", param, ctx)
        return amount


USD = UsdAmount()


def _run(url: str, action: Callable[[Database], Awaitable[T]]) -> T:
    async def main() -> T:
        db = await Database.open(url)
        try:
            return await action(db)
        finally:
            await db.close()

    try:
        return asyncio.run(main())
    except (AccountsError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc


def _usd(amount: Decimal) -> str:
    return f"{amount:.9f}".rstrip("0").rstrip(".") if amount else "0"


@click.group()
def orgs() -> None:
    """Manage organizations: credits and concurrency limits."""


@orgs.command("create")
@click.argument("name")
@click.option("--credits", "credits_usd", type=USD, required=True, help="Starting credits, USD.")
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=DEFAULT_CONCURRENCY_LIMIT,
    show_default=True,
    help="Requests the organization may have in flight at once.",
)
@database_url_option
def orgs_create(name: str, credits_usd: Decimal, concurrency: int, database_url: str) -> None:
    """Create organization NAME."""
    org = _run(
        database_url,
        lambda db: create_org(db, name, credits_usd=credits_usd, concurrency_limit=concurrency),
    )
    click.echo(
        f"created organization {org.name}: credits {_usd(org.credits_usd)} USD, "
        f"concurrency {org.concurrency_limit}"
    )


@orgs.command("credit")
@click.argument("name")
@click.argument("usd", type=USD)
@database_url_option
def orgs_credit(name: str, usd: Decimal, database_url: str) -> None:
    """Add USD credits to organization NAME (a negative amount removes credits)."""
    org = _run(database_url, lambda db: credit_org(db, name, usd))
    click.echo(f"{org.name}: credits {_usd(org.credits_usd)} USD")


@orgs.command("list")
@database_url_option
def orgs_list(database_url: str) -> None:
    """List organizations with their credits and concurrency limits."""
    rows = _run(database_url, list_orgs)
    click.echo(f"{'NAME':<30} {'CREDITS_USD':>20} {'CONCURRENCY':>11}  CREATED")
    for org in rows:
        click.echo(
            f"{org.name:<30} {_usd(org.credits_usd):>20} {org.concurrency_limit:>11}  "
            f"{org.created_at:%Y-%m-%d %H:%M:%S}Z"
        )


@click.group()
def keys() -> None:
    """Manage API keys (stored hashed; only prefixes can be listed)."""


def _split_models(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [m.strip() for m in value.split(",") if m.strip()]


@keys.command("create")
@click.option("--org", "org_name", required=True, help="Organization that owns the key.")
@click.option("--models", default=None, help="Comma-separated model ids the key may use (default: all).")
@database_url_option
def keys_create(org_name: str, models: str | None, database_url: str) -> None:
    """Create a key; the key itself is printed once, alone on the last line."""
    new = _run(database_url, lambda db: create_key(db, org_name, models=_split_models(models)))
    allowed = ",".join(new.info.allowed_models) if new.info.allowed_models else "all"
    click.echo(f"created key {new.info.prefix} for {new.info.org_name} (models: {allowed})")
    click.echo("store it now; it cannot be shown again:")
    click.echo(new.key)


@keys.command("list")
@click.option("--org", "org_name", required=True)
@database_url_option
def keys_list(org_name: str, database_url: str) -> None:
    """List an organization's keys by prefix."""
    rows = _run(database_url, lambda db: list_keys(db, org_name))
    click.echo(f"{'PREFIX':<20} {'STATUS':<8} {'CREATED':<20} MODELS")
    for key in rows:
        status = "revoked" if key.revoked else "active"
        allowed = ",".join(key.allowed_models) if key.allowed_models else "all"
        click.echo(f"{key.prefix:<20} {status:<8} {key.created_at:%Y-%m-%d %H:%M:%S}Z {allowed}")


@keys.command("revoke")
@click.argument("key_prefix")
@database_url_option
def keys_revoke(key_prefix: str, database_url: str) -> None:
    """Revoke the key with KEY_PREFIX (e.g. sk-kiln-abcd1234); gateways refuse it within seconds."""
    info = _run(database_url, lambda db: revoke_key(db, key_prefix))
    click.echo(f"revoked key {info.prefix} of {info.org_name}")


admin = click.Group("admin", commands={"orgs": orgs, "keys": keys}, help="Accounts administration.")
