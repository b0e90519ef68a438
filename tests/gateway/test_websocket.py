"""WebSocket mode in-process (fake worker, Starlette's test client): the frames, the error frames
that leave the socket usable, the connection's continuation state, the off switch, the upgrade
refusals (Host/Origin locally, the key in hosted mode) and per-turn admission.

The real SDK against real processes is in tests/e2e/test_websocket_real_model.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from kiln.gateway.doors.websocket.connection_state import ConnectionState
from kiln.gateway.http.app import create_app
from kiln.gateway.settings import Settings
from kiln.protocol import Generate
from kiln.protocol.usage import Usage
from tests.conformance.websocket import assert_ws_error, assert_ws_turn
from tests.gateway.inprocess import MODEL, FakePool, hosted_app, local_app

URL = "ws://127.0.0.1/v1/responses"


def _turn(ws, **body) -> list[dict]:
    """Send one response.create and collect its frames up to the terminal one (or an error)."""
    ws.send_text(json.dumps({"type": "response.create", "model": MODEL, **body}))
    frames = []
    while True:
        frame = json.loads(ws.receive_text())
        frames.append(frame)
        if frame["type"] in ("error", "response.completed", "response.incomplete", "response.failed"):
            return frames


@pytest.fixture
def local():
    app, pool = local_app()
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.pool = pool
        yield client


def test_a_turn_streams_numbered_events_that_validate(local):
    with local.websocket_connect(URL) as ws:
        frames = _turn(ws, input="hi", store=False)
    assert_ws_turn(frames)
    assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
    assert frames[-1]["response"]["status"] == "completed"
    assert not local.pool.leaked()


def test_also_mounted_without_v1(local):
    with local.websocket_connect("ws://127.0.0.1/responses") as ws:
        assert_ws_turn(_turn(ws, input="hi"))


def test_bad_messages_get_error_frames_and_the_socket_stays_usable(local):
    with local.websocket_connect(URL) as ws:
        cases = [
            ("{not json", None),
            ('"a string"', None),
            (json.dumps({"type": "response.cancel"}), "type"),
            (json.dumps({"type": "response.create", "model": MODEL, "input": "x", "background": True}), "background"),
            (json.dumps({"type": "response.create", "model": MODEL, "input": "x", "stream": False}), "stream"),
            (json.dumps({"type": "response.create", "model": MODEL, "input": "x", "temperature": "hot"}), "temperature"),
            (json.dumps({"type": "response.create", "model": "no-such-model", "input": "x"}), "model"),
        ]
        for text, param in cases:
            ws.send_text(text)
            frame = json.loads(ws.receive_text())
            assert_ws_error(frame)
            assert frame["status"] in (400, 404), frame
            if param is not None:
                assert frame["error"]["param"] == param, frame
        # still usable
        assert_ws_turn(_turn(ws, input="after the errors"))


def test_store_false_chain_continues_from_the_connection_state(local):
    with local.websocket_connect(URL) as ws:
        first = _turn(ws, input="one", store=False)[-1]["response"]
        second = _turn(ws, input="two", store=False, previous_response_id=first["id"])
        assert_ws_turn(second)
        assert second[-1]["response"]["previous_response_id"] == first["id"]
        third = _turn(ws, input="three", store=False, previous_response_id=second[-1]["response"]["id"])
        assert_ws_turn(third)
    # nothing of the store:false chain reached the response store
    assert local.get(f"/v1/responses/{first['id']}").status_code == 404


def test_unknown_previous_id_and_reconnect_give_previous_response_not_found(local):
    with local.websocket_connect(URL) as ws:
        frame = _turn(ws, input="x", previous_response_id="resp_" + "0" * 32)[-1]
        assert_ws_error(frame)
        assert frame["status"] == 400 and frame["error"]["code"] == "previous_response_not_found"
        first = _turn(ws, input="one", store=False)[-1]["response"]
    with local.websocket_connect(URL) as ws:
        frame = _turn(ws, input="two", store=False, previous_response_id=first["id"])[-1]
        assert frame["type"] == "error" and frame["error"]["code"] == "previous_response_not_found"
        # store:true chains outlive the socket: they resolve from the response store
        stored = _turn(ws, input="kept", store=True)[-1]["response"]
    with local.websocket_connect(URL) as ws:
        assert_ws_turn(_turn(ws, input="more", previous_response_id=stored["id"]))


def test_an_output_for_no_call_is_400_and_evicts_the_continuation(local):
    """As OpenAI (and the Open Responses suite's websocket-failed-continuation-evicts-cache): a
    function_call_output whose call_id names no call is refused, and the failed continuation
    takes the response it continued out of the connection's state."""
    orphan = {"type": "function_call_output", "call_id": "call_nowhere", "output": "42"}
    with local.websocket_connect(URL) as ws:
        first = _turn(ws, input="one", store=False)[-1]["response"]
        frame = _turn(ws, input=[orphan], store=False, previous_response_id=first["id"])[-1]
        assert_ws_error(frame)
        assert frame["status"] == 400 and frame["error"]["param"] == "input" and "call_nowhere" in frame["error"]["message"]
        again = _turn(ws, input="two", store=False, previous_response_id=first["id"])[-1]
        assert again["type"] == "error" and again["error"]["code"] == "previous_response_not_found"
    r = local.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": "hi"}, orphan]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    call = {"type": "function_call", "call_id": "call_here", "name": "f", "arguments": "{}"}
    ok = local.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": "hi"}, call, {**orphan, "call_id": "call_here"}]})
    assert ok.status_code == 200, ok.text


def test_warm_up_is_a_completed_response_without_output(local):
    with local.websocket_connect(URL) as ws:
        frames = _turn(ws, input="warm me", generate=False, store=False)
        assert_ws_turn(frames)
        assert [f["type"] for f in frames] == ["response.created", "response.in_progress", "response.completed"]
        done = frames[-1]["response"]
        assert done["output"] == [] and done["usage"]["output_tokens"] == 0
        assert_ws_turn(_turn(ws, input=[], previous_response_id=done["id"], store=False))


class SlowPrefillPool(FakePool):
    """A fake worker whose warm-up prefill (a one-token request) takes ``prefill_s``: it reports the
    prompt's size at its first prefilled chunk, as the real worker does, and ends later."""

    prefill_s = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, float]] = []

    async def _send(self, identity, message):
        from kiln.protocol import Done, Event
        from kiln.protocol.codec import decode, encode

        message = decode(encode(message))
        if isinstance(message, Generate) and message.request.sampling.max_output_tokens == 1:
            loop = asyncio.get_running_loop()
            self.log.append(("warm-up sent", loop.time()))

            async def prefill() -> None:
                await self._dispatch(identity, Event(message.req_id, [], Usage(input_tokens=1300)))
                await asyncio.sleep(self.prefill_s)
                self.log.append(("warm-up done", loop.time()))
                await self._dispatch(identity, Done(message.req_id, "incomplete", Usage(input_tokens=1300, output_tokens=1), {"reason": "max_output_tokens"}))

            asyncio.ensure_future(prefill())
            return
        if isinstance(message, Generate):
            self.log.append(("turn sent", asyncio.get_running_loop().time()))
        await super()._send(identity, message)


def test_a_slow_warm_up_is_answered_early_and_its_turn_waits_for_the_prefill(monkeypatch):
    """Issue 28 item 6: Codex drops a socket whose warm-up has not answered within 15 s of opening
    it. A warm-up still prefilling after WARM_UP_ANSWER_S is answered completed (no output, the
    input usage reported so far); the continuation on the socket reaches the worker only once the
    prefill is done, so it starts on the cached prompt."""
    from kiln.gateway.doors.websocket import routes as route

    monkeypatch.setattr(route, "WARM_UP_ANSWER_S", 0.1)
    pool = SlowPrefillPool()
    app = create_app(Settings(), pool=pool)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        with client.websocket_connect(URL) as ws:
            frames = _turn(ws, input="a long agent prompt", generate=False, store=False)
            assert_ws_turn(frames)
            done = frames[-1]["response"]
            assert frames[-1]["type"] == "response.completed" and done["output"] == []
            assert done["usage"]["input_tokens"] == 1300 and done["usage"]["output_tokens"] == 0
            assert [name for name, _ in pool.log] == ["warm-up sent"]  # answered mid-prefill
            turn = _turn(ws, input=[], previous_response_id=done["id"], store=False)
            assert_ws_turn(turn)
            assert turn[-1]["response"]["status"] == "completed"
    names = [name for name, _ in pool.log]
    assert names == ["warm-up sent", "warm-up done", "turn sent"], names
    assert not pool.leaked()


class FailingPrefillPool(SlowPrefillPool):
    """The slow warm-up's prefill fails (the worker died, say) after it was answered early."""

    async def _send(self, identity, message):
        from kiln.protocol import Event, Failed
        from kiln.protocol.codec import decode, encode

        message = decode(encode(message))
        if isinstance(message, Generate) and message.request.sampling.max_output_tokens == 1:
            self.log.append(("warm-up sent", asyncio.get_running_loop().time()))

            async def prefill() -> None:
                await self._dispatch(identity, Event(message.req_id, [], Usage(input_tokens=1300)))
                await asyncio.sleep(self.prefill_s)
                await self._dispatch(identity, Failed(message.req_id, 502, "server_error", "the worker stopped responding during generation"))

            asyncio.ensure_future(prefill())
            return
        await super()._send(identity, message)


def test_a_warm_up_answered_early_whose_prefill_fails_still_continues(monkeypatch):
    # The client was told the warm-up completed: its continuation must not then be refused with
    # previous_response_not_found. It runs, on a cold prompt.
    from kiln.gateway.doors.websocket import routes as route

    monkeypatch.setattr(route, "WARM_UP_ANSWER_S", 0.1)
    pool = FailingPrefillPool()
    pool.prefill_s = 0.3
    app = create_app(Settings(), pool=pool)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        with client.websocket_connect(URL) as ws:
            frames = _turn(ws, input="a long agent prompt", generate=False, store=False)
            assert frames[-1]["type"] == "response.completed"
            turn = _turn(ws, input="and now?", previous_response_id=frames[-1]["response"]["id"], store=False)
            assert_ws_turn(turn)
            assert turn[-1]["type"] == "response.completed", turn[-1]
    assert not pool.leaked()


def test_off_switch_answers_426():
    app, _ = local_app(websocket="off")
    with TestClient(app, base_url="http://127.0.0.1") as client:
        with pytest.raises(WebSocketDenialResponse) as denied:
            with client.websocket_connect(URL):
                pass
    assert denied.value.status_code == 426
    assert denied.value.json()["error"]["code"] == "websocket_not_supported"


def test_foreign_origin_and_host_are_refused_on_the_upgrade(local):
    for headers in ({"origin": "https://evil.example"}, {"host": "evil.example"}):
        with pytest.raises(WebSocketDenialResponse) as denied:
            with local.websocket_connect(URL, headers=headers):
                pass
        assert denied.value.status_code == 403


def test_connection_cap_refuses_the_upgrade_beyond_it():
    app, _ = local_app(websocket_max_connections=1)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        with client.websocket_connect(URL) as ws:
            with pytest.raises(WebSocketDenialResponse) as denied:
                with client.websocket_connect(URL):
                    pass
            assert denied.value.status_code == 503
            assert_ws_turn(_turn(ws, input="still fine"))


def test_lifetime_limit_closes_with_its_error():
    app, _ = local_app(websocket_max_age_s=0.5)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        with client.websocket_connect(URL) as ws:
            frame = json.loads(ws.receive_text())  # sent once the 0.5 s lifetime is over
            assert_ws_error(frame)
            assert frame["error"]["code"] == "websocket_connection_limit_reached"


def test_oversized_frame_is_refused_with_413():
    app, _ = local_app(max_body_bytes=1000)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        with client.websocket_connect(URL) as ws:
            ws.send_text(json.dumps({"type": "response.create", "model": MODEL, "input": "x" * 2000}))
            frame = json.loads(ws.receive_text())
            assert frame["status"] == 413 and frame["error"]["code"] == "request_too_large"
            assert_ws_turn(_turn(ws, input="small"))


def test_connection_state_is_bounded():
    state = ConnectionState(max_entries=2, max_bytes=10_000)
    for i in range(3):
        assert state.remember(f"r{i}", [{"type": "message", "role": "user", "content": "x"}], [])
    assert "r0" not in state and len(state) == 2
    assert not state.remember("big", [{"type": "message", "role": "user", "content": "x" * 20_000}], [])
    assert "big" not in state


async def test_hosted_upgrade_needs_a_key_and_each_turn_is_one_ledger_row(tmp_path):
    app, _, key = await hosted_app(tmp_path)
    await app.state.accounts.close()  # reopened by the test client's lifespan, on its own loop
    with TestClient(app, base_url="http://127.0.0.1") as client:
        with pytest.raises(WebSocketDenialResponse) as denied:
            with client.websocket_connect(URL):
                pass
        assert denied.value.status_code == 401
        with client.websocket_connect(URL, headers={"authorization": f"Bearer {key}"}) as ws:
            for _ in range(2):
                assert_ws_turn(_turn(ws, input="hi", store=False))
            # store none: an unknown id is previous_response_not_found, not unsupported_parameter
            frame = _turn(ws, input="x", store=False, previous_response_id="resp_unknown")[-1]
            assert frame["error"]["code"] == "previous_response_not_found"
    rows = sqlite3.connect(tmp_path / "accounts.db").execute("select status from usage_events").fetchall()
    assert [r[0] for r in rows].count("completed") == 2, rows


async def test_hosted_turn_beyond_the_orgs_concurrency_gets_429_and_the_socket_idles_without_a_slot(tmp_path):
    """The slot is taken per turn: while the organization's other work holds every slot a turn
    gets a 429 error frame (socket still usable); an open, idle socket holds none."""
    from kiln.gateway.http.errors import ApiError

    app, _, key = await hosted_app(tmp_path)
    await app.state.accounts.close()
    org_id, limit = sqlite3.connect(tmp_path / "accounts.db").execute("select id, concurrency_limit from organizations where name = 'acme'").fetchone()
    with TestClient(app, base_url="http://127.0.0.1") as client:
        limiter = app.state.accounts.limiter
        with client.websocket_connect(URL, headers={"authorization": f"Bearer {key}"}) as ws:
            assert_ws_turn(_turn(ws, input="hi", store=False))
            held = [client.portal.call(limiter.acquire, org_id, limit) for _ in range(limit)]  # the idle socket holds none
            with pytest.raises(ApiError):
                client.portal.call(limiter.acquire, org_id, limit)
            frame = _turn(ws, input="hi", store=False)[-1]
            assert_ws_error(frame)
            assert frame["status"] == 429 and frame["error"]["code"] == "rate_limit_exceeded"
            client.portal.call(held.pop().release)
            assert_ws_turn(_turn(ws, input="hi", store=False))
            assert client.portal.call(limiter.in_flight, org_id) == limit - 1  # the turn's slot went back
            for slot in held:
                client.portal.call(slot.release)


async def test_one_orgs_sockets_never_lock_out_another_org(tmp_path):
    """Issue 30 tenants 2: an organization holding its share of sockets gets 429 on its next
    upgrade; another organization's upgrade still opens (the cap was global: it got 503)."""
    from kiln.gateway.accounts.keys import create_key
    from kiln.gateway.accounts.orgs import create_org

    app, _, key = await hosted_app(tmp_path)
    app.state.settings = dataclasses.replace(app.state.settings, websocket_max_connections=3, websocket_max_connections_per_org=2)
    await create_org(app.state.accounts.db, "globex", credits_usd=10)
    other = (await create_key(app.state.accounts.db, "globex")).key
    await app.state.accounts.close()
    with TestClient(app, base_url="http://127.0.0.1") as client:
        acme = {"authorization": f"Bearer {key}"}
        with client.websocket_connect(URL, headers=acme), client.websocket_connect(URL, headers=acme):
            with pytest.raises(WebSocketDenialResponse) as denied:
                with client.websocket_connect(URL, headers=acme):
                    pass
            assert denied.value.status_code == 429 and denied.value.json()["error"]["code"] == "rate_limit_exceeded"
            with client.websocket_connect(URL, headers={"authorization": f"Bearer {other}"}) as ws:
                assert_ws_turn(_turn(ws, input="hi", store=False))
        with client.websocket_connect(URL, headers=acme) as ws:  # closed sockets count no more
            assert_ws_turn(_turn(ws, input="hi", store=False))


def _closed_with(ws) -> int:
    """The close code the server ends the socket with (after the frames already read)."""
    message = ws.receive()
    assert message["type"] == "websocket.close", message
    return message["code"]


async def test_hosted_socket_stops_at_the_first_turn_after_its_key_is_revoked(tmp_path):
    """Issue 30 B: the key is checked on every turn, not only on the upgrade."""
    import time

    app, _, key = await hosted_app(tmp_path)
    await app.state.accounts.close()
    db = sqlite3.connect(tmp_path / "accounts.db")
    with TestClient(app, base_url="http://127.0.0.1") as client:
        with client.websocket_connect(URL, headers={"authorization": f"Bearer {key}"}) as ws:
            assert_ws_turn(_turn(ws, input="hi", store=False))
            db.execute("update api_keys set revoked = 1")  # what `kiln keys revoke` does
            db.commit()
            time.sleep(app.state.settings.auth_cache_ttl + 0.5)  # the auth cache's bound
            frame = _turn(ws, input="hi", store=False)[-1]
            assert_ws_error(frame)
            assert frame["status"] == 401 and frame["error"]["code"] == "invalid_api_key"
            assert _closed_with(ws) == 1008
    rows = db.execute("select status from usage_events").fetchall()
    assert [r[0] for r in rows] == ["completed"], rows  # the refused turn ran nothing and cost nothing


async def test_hosted_socket_stops_at_the_first_turn_in_maintenance(tmp_path):
    app, _, key = await hosted_app(tmp_path)
    await app.state.accounts.close()
    with TestClient(app, base_url="http://127.0.0.1") as client:
        with client.websocket_connect(URL, headers={"authorization": f"Bearer {key}"}) as ws:
            assert_ws_turn(_turn(ws, input="hi", store=False))
            r = client.post("/admin/maintenance", json={"on": True, "retry_after": 30}, headers={"authorization": "Bearer admin-secret"})
            assert r.status_code == 200, r.text
            frame = _turn(ws, input="hi", store=False)[-1]
            assert_ws_error(frame)
            assert frame["status"] == 503
            assert _closed_with(ws) == 1013


def test_codex_config_turns_websockets_on_and_says_how_to_turn_it_off(tmp_path):
    import tomllib

    from kiln.codex_config import provider_block

    for on in (True, False):
        text = provider_block(model="m", base_url="http://127.0.0.1:8080/v1", catalog_path=tmp_path / "c.json", websockets=on)
        assert tomllib.loads(text)["model_providers"]["kiln"]["supports_websockets"] is on
        assert "--websocket off" in text


class _SlowPool(FakePool):
    """The fake worker, answering each generation after ``delay_s`` (so that turns queue)."""

    delay_s = 0.5

    async def _send(self, identity, message):
        if not isinstance(message, Generate):
            return await super()._send(identity, message)

        async def later():
            await asyncio.sleep(self.delay_s)
            await super(_SlowPool, self)._send(identity, message)

        self._later = asyncio.ensure_future(later())


def test_frames_waiting_behind_a_turn_are_bounded_in_bytes():
    """Issue 30 item 6: what waits behind the running turn counts against the body budget (here
    10 kB): 32 frames of the largest body each were a gigabyte queued by one client. The frame
    beyond it is refused with 413 and the socket closed 1009, after the turns already waiting."""
    pool = _SlowPool()
    app = create_app(Settings(max_body_bytes=10_000), pool=pool)
    frame = json.dumps({"type": "response.create", "model": MODEL, "input": "x" * 4000})
    with TestClient(app, base_url="http://127.0.0.1") as client:
        with client.websocket_connect(URL) as ws:
            ws.send_text(frame)
            assert json.loads(ws.receive_text())["type"] == "response.created"  # turn 1 runs
            for _ in range(3):  # 2 fit in 10 kB while turn 1 runs, the 3rd does not
                ws.send_text(frame)
            terminal: list[str] = []
            while len(terminal) < 4:  # before the bound: all 4 turns ran, and no error came
                got = json.loads(ws.receive_text())
                if got["type"] == "error":
                    break
                if got["type"] in ("response.completed", "response.failed", "response.incomplete"):
                    terminal.append(got["type"])
            assert terminal == ["response.completed"] * 3
            assert_ws_error(got)
            assert got["status"] == 413 and got["error"]["code"] == "request_too_large"
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_text()
            assert closed.value.code == 1009
