"""``/metrics`` is the operator's: in hosted mode it needs the admin token, which can come from a
file or the environment instead of a flag that ``ps`` shows (a flag still works, with a warning)."""

from __future__ import annotations

import asyncio
import json
import secrets
from decimal import Decimal

import httpx

from kiln.gateway.accounts.db import Database
from kiln.gateway.accounts.keys import create_key
from kiln.gateway.accounts.orgs import create_org
from tests.conformance import assert_error
from tests.support import Kiln


def _tenant_key(url: str) -> str:
    async def go() -> str:
        db = await Database.open(url)
        try:
            await create_org(db, "tenant", credits_usd=Decimal("1"))
            return (await create_key(db, "tenant")).key
        finally:
            await db.close()

    return asyncio.run(go())


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_hosted_metrics_need_the_admin_token_from_a_file(tmp_path):
    url = f"sqlite:///{tmp_path}/kiln.db"
    key = _tenant_key(url)
    token = "admin-" + secrets.token_hex(8)
    token_file = tmp_path / "admin-token"
    token_file.write_text(token + "\n")
    server = Kiln(tmp_path, gateway_args=["--auth", "keys", "--database-url", url, "--admin-token-file", str(token_file)], workers=0).start(timeout=60)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as c:
            ok = c.get("/metrics", headers=_bearer(token))
            assert ok.status_code == 200, ok.text
            assert "kiln_requests_in_flight" in ok.text
            tenant = c.get("/metrics", headers=_bearer(key))
            assert tenant.status_code == 403, tenant.text
            assert_error(tenant.json())
            for headers in ({}, _bearer("sk-kiln-wrong"), {"Authorization": f"Basic {token}"}):
                r = c.get("/metrics", headers=headers)
                assert r.status_code == 401, r.text
                assert_error(r.json())
            # The token read from the file also guards /admin/maintenance.
            assert c.get("/admin/maintenance", headers=_bearer(token)).status_code == 200
        assert token not in " ".join(server.gateway.process.args)  # nothing for `ps` to show
    finally:
        server.stop()
    assert not any(e.get("logger") == "kiln.security" for e in _json_lines(server.gateway.log()))


def test_admin_token_flag_works_but_warns_and_env_does_not(tmp_path):
    url = f"sqlite:///{tmp_path}/kiln.db"
    token = "admin-" + secrets.token_hex(8)
    flagged = Kiln(tmp_path, gateway_args=["--auth", "keys", "--database-url", url, "--admin-token", token], workers=0).start(timeout=60)
    try:
        assert httpx.get(flagged.base_url + "/metrics", headers=_bearer(token), timeout=30).status_code == 200
    finally:
        flagged.stop()
    warnings = [e for e in _json_lines(flagged.gateway.log()) if e.get("logger") == "kiln.security"]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning" and token not in json.dumps(warnings)

    (tmp_path / "env").mkdir()
    from_env = Kiln(tmp_path / "env", gateway_args=["--auth", "keys", "--database-url", url], workers=0, env={"KILN_ADMIN_TOKEN": token}).start(timeout=60)
    try:
        assert httpx.get(from_env.base_url + "/metrics", headers=_bearer(token), timeout=30).status_code == 200
        assert httpx.get(from_env.base_url + "/metrics", timeout=30).status_code == 401
    finally:
        from_env.stop()
    assert not any(e.get("logger") == "kiln.security" for e in _json_lines(from_env.gateway.log()))


def test_local_metrics_stay_open(tmp_path):
    server = Kiln(tmp_path, workers=0).start(timeout=60)
    try:
        r = httpx.get(server.base_url + "/metrics", timeout=30)
        assert r.status_code == 200 and "kiln_requests_in_flight" in r.text
    finally:
        server.stop()
