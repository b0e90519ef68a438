"""A worker that sheds load (its queue or its preparation pool full: 503 ``server_is_overloaded``)
is passed on to the client as 503 with Retry-After, the answer clients back off on (issue 30
item 8), when no other worker of the model has room. In-process, with a fake worker that refuses."""

from __future__ import annotations

from typing import Any

from kiln.gateway.http.app import create_app
from kiln.gateway.settings import Settings
from kiln.protocol import Failed, Generate
from tests.conformance import assert_error
from tests.gateway.inprocess import MODEL, FakePool, bounded, client_for


class SheddingPool(FakePool):
    async def _send(self, identity: bytes, message: Any) -> None:
        if isinstance(message, Generate):
            await self._dispatch(identity, Failed(message.req_id, 503, "server_is_overloaded", "The worker is busy preparing other requests; retry shortly."))
            return
        await super()._send(identity, message)


async def test_worker_refusal_reaches_the_client_as_503_with_retry_after():
    app = create_app(Settings(), pool=SheddingPool())
    async with client_for(app) as client:
        r = await bounded(client.post("/v1/responses", json={"model": MODEL, "input": "hi"}))
    assert r.status_code == 503
    assert_error(r.json())
    assert r.json()["error"]["code"] == "server_is_overloaded"
    assert r.headers["retry-after"] == "1"
