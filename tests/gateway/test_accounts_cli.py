"""`kiln orgs` / `kiln keys` through click's CliRunner, against a temp SQLite file."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner

from kiln.admin import admin, keys, orgs
from kiln.gateway.accounts.auth import Authenticator
from kiln.gateway.accounts.db import Database
from kiln.gateway.http.errors import ApiError


@pytest.fixture
def cli(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_DATABASE_URL", f"sqlite:///{tmp_path}/kiln.db")
    runner = CliRunner()

    def run(group, *args: str, ok: bool = True):
        result = runner.invoke(group, list(args))
        if ok:
            assert result.exit_code == 0, result.output
        return result

    run.url = f"sqlite:///{tmp_path}/kiln.db"
    return run


def _authenticate(url: str, key: str, model: str | None):
    async def go():
        db = await Database.open(url)
        try:
            return await Authenticator(db, cache_ttl=0).authenticate(f"Bearer {key}", model)
        finally:
            await db.close()

    return asyncio.run(go())


def test_orgs_create_credit_list(cli):
    cli(orgs, "create", "acme", "--credits", "10.50", "--concurrency", "4")
    cli(orgs, "credit", "acme", "2.25")
    cli(orgs, "credit", "acme", "--", "-0.75")
    listing = cli(orgs, "list").output
    assert "acme" in listing and "12" in listing and " 4 " in listing
    dup = cli(orgs, "create", "acme", "--credits", "1", ok=False)
    assert dup.exit_code == 1 and "already exists" in dup.output
    missing = cli(orgs, "credit", "nobody", "1", ok=False)
    assert missing.exit_code == 1 and "nobody" in missing.output
    assert cli(orgs, "create", "x", "--credits", "abc", ok=False).exit_code == 2


def test_keys_create_list_revoke(cli):
    cli(orgs, "create", "acme", "--credits", "1")
    created = cli(keys, "create", "--org", "acme", "--models", "m-a, m-b")
    key = created.output.strip().splitlines()[-1]
    assert key.startswith("sk-kiln-") and " " not in key
    principal = _authenticate(cli.url, key, "m-a")
    assert principal.org_name == "acme"
    with pytest.raises(ApiError) as err:
        _authenticate(cli.url, key, "m-c")
    assert err.value.status == 403

    listing = cli(keys, "list", "--org", "acme").output
    assert principal.key_prefix in listing and key not in listing and "active" in listing
    cli(keys, "revoke", principal.key_prefix)
    assert "revoked" in cli(keys, "list", "--org", "acme").output
    with pytest.raises(ApiError) as err:
        _authenticate(cli.url, key, "m-a")
    assert err.value.status == 401
    assert cli(keys, "revoke", "sk-kiln-nothere0", ok=False).exit_code == 1
    assert cli(keys, "create", "--org", "nobody", ok=False).exit_code == 1


def test_database_url_option_and_admin_group(tmp_path):
    url = f"sqlite:///{tmp_path}/other.db"
    runner = CliRunner()
    result = runner.invoke(admin, ["orgs", "create", "solo", "--credits", "3", "--database-url", url])
    assert result.exit_code == 0, result.output
    assert "solo" in runner.invoke(admin, ["orgs", "list", "--database-url", url]).output
