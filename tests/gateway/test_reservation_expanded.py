"""Issue 30 tenants 1: the credit reservation covers the input as it is sent, with the history a
``conversation`` expands to, not only the request's own short body (in process; the fake worker
holds each generation until the test releases it, so requests overlap as concurrent ones do)."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

from kiln.gateway.accounts.admission import _reservation_tokens
from kiln.gateway.http.app import create_app
from kiln.gateway.settings import Settings
from kiln.protocol import Done, Generate, decode, encode
from kiln.protocol.usage import Usage
from tests.conformance import assert_error
from tests.gateway.inprocess import CONTEXT_WINDOW, MODEL, FakePool, bounded, client_for

CATALOG = f'[models."{MODEL}"]\ninput = "100"\noutput = "100"\n'
TRANSCRIPT = [{"type": "message", "role": "user", "content": "a long shared history " * 50} for _ in range(20)]


class HoldingPool(FakePool):
    """Generations wait at the fake worker until ``release`` answers them."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Any] = []

    async def _send(self, identity: bytes, message: Any) -> None:
        message = decode(encode(message))
        if isinstance(message, Generate):
            self.held.append((identity, message))
            return
        await super()._send(identity, message)

    async def release(self) -> None:
        held, self.held = self.held, []
        for identity, message in held:
            await self._dispatch(identity, Done(message.req_id, "completed", Usage(input_tokens=3, output_tokens=1)))


async def test_a_conversations_history_is_reserved_before_any_work(tmp_path):
    from kiln.gateway.accounts.keys import create_key
    from kiln.gateway.accounts.money import nanos_to_usd
    from kiln.gateway.accounts.orgs import create_org

    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG)
    pool = HoldingPool()
    settings = Settings(auth="keys", database_url=f"sqlite:///{tmp_path}/accounts.db", store_mode="memory", catalog_path=str(catalog))
    app = create_app(settings, pool=pool)
    accounts = app.state.accounts
    await accounts.open()
    body = {"model": MODEL, "input": "and now?", "max_output_tokens": 16}
    own = accounts.meter.price_nanos(MODEL, *_reservation_tokens(body, CONTEXT_WINDOW))
    expanded = accounts.meter.price_nanos(MODEL, *_reservation_tokens({**body, "input": TRANSCRIPT + [body["input"]]}, CONTEXT_WINDOW))
    assert expanded > 3 * own
    # Enough for two reservations of the body alone, not for one of the body with its history.
    await create_org(accounts.db, "acme", credits_usd=nanos_to_usd(2 * own + own // 2))
    key = (await create_key(accounts.db, "acme")).key
    headers = {"authorization": f"Bearer {key}"}
    try:
        async with client_for(app) as c:
            conv = await bounded(c.post("/v1/conversations", json={"items": TRANSCRIPT}, headers=headers))
            assert conv.status_code == 200, conv.text
            first = asyncio.ensure_future(c.post("/v1/responses", json={**body, "conversation": conv.json()["id"]}, headers=headers))
            for _ in range(200):
                if pool.held:
                    break
                await asyncio.sleep(0.01)
            assert pool.held, "the first request never reached the worker"
            pending = sqlite3.connect(tmp_path / "accounts.db").execute("select cost_nanousd from usage_events where status = 'pending'").fetchall()
            assert pending == [(expanded,)]  # the reservation covers the history
            # The balance went below zero covering it: the next request is refused at once, so the
            # organization overdraws by at most that one reservation.
            second = await bounded(c.post("/v1/responses", json={**body, "conversation": conv.json()["id"]}, headers=headers))
            assert second.status_code == 402, second.text
            assert_error(second.json())
            assert len(pool.held) == 1
            await pool.release()
            assert (await bounded(first)).status_code == 200
    finally:
        await accounts.close()
