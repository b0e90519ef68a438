"""Issue 30 item 10: adding an item to a large conversation costs the item, not the conversation.

Measured in bytes, not time: every byte the gateway serializes or parses as JSON while it answers
one small ``POST /v1/conversations/{id}/items`` (and a GET and a metadata update of the
conversation) is counted. A ~4 MB conversation used to be re-serialized (memory store: its size
recounted) or loaded whole (Redis: read back twice to check that it exists) for each append.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from kiln.gateway.http.app import create_app
from kiln.gateway.settings import Settings
from tests.gateway.inprocess import FakePool, bounded, client_for
from tests.redis_support import drop_namespace, new_namespace, shared_redis_url

ITEM_TEXT = "y" * 50_000
BATCHES = 4  # of 20 items of 50 KB: a conversation of ~4 MB
SMALL_BOUND = 100_000  # bytes one small call may touch: its own item, the answer, some slack


@contextlib.contextmanager
def json_bytes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the bytes every json.dumps produces and every json.loads reads, in this process."""
    seen = [0]
    dumps, loads = json.dumps, json.loads

    def counting_dumps(*args: Any, **kw: Any) -> str:
        out = dumps(*args, **kw)
        seen[0] += len(out)
        return out

    def counting_loads(raw: Any, *args: Any, **kw: Any) -> Any:
        seen[0] += len(raw)
        return loads(raw, *args, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(json, "dumps", counting_dumps)
        patch.setattr(json, "loads", counting_loads)
        yield seen


@contextlib.asynccontextmanager
async def gateway(mode: str) -> AsyncIterator[Any]:
    if mode == "memory":
        yield create_app(Settings(), pool=FakePool())
        return
    url, namespace = shared_redis_url(), new_namespace()
    app = create_app(Settings(store_mode="redis", redis_url=url, redis_namespace=namespace), pool=FakePool())
    try:
        async with app.router.lifespan_context(app):
            yield app
    finally:
        drop_namespace(url, namespace)


@pytest.mark.parametrize("mode", ["memory", "redis"])
async def test_small_calls_on_a_large_conversation_do_not_touch_all_of_it(mode, monkeypatch):
    async with gateway(mode) as app, client_for(app) as c:
        big = [{"role": "user", "content": ITEM_TEXT} for _ in range(20)]
        conv = (await bounded(c.post("/v1/conversations", json={"items": big}))).json()["id"]
        for _ in range(BATCHES - 1):
            assert (await bounded(c.post(f"/v1/conversations/{conv}/items", json={"items": big}))).status_code == 200
        with json_bytes(monkeypatch) as seen:
            added = await bounded(c.post(f"/v1/conversations/{conv}/items", json={"items": [{"role": "user", "content": "one more"}]}))
            got = await bounded(c.get(f"/v1/conversations/{conv}"))
            updated = await bounded(c.post(f"/v1/conversations/{conv}", json={"metadata": {"k": "v"}}))
        assert added.status_code == 200 and got.status_code == 200 and updated.status_code == 200
        assert seen[0] < SMALL_BOUND, f"{seen[0]} bytes of JSON for three small calls on a {BATCHES * 20 * len(ITEM_TEXT)}-byte conversation"
        listed = (await bounded(c.get(f"/v1/conversations/{conv}/items", params={"limit": 1}))).json()["data"]
        assert listed[0]["content"][0]["text"] == "one more"  # the append landed
