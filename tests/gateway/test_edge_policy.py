"""The HTTP edge in-process: Host, Origin, CORS, Content-Type, the concurrency cap, the body deadline.

Everything here runs the middleware (alone or inside the real app) over httpx's ASGI transport or a
hand-driven ``receive``, so no process or socket is involved; the slow-client cases against a real
Hypercorn are in test_edge_slow_clients.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kiln.gateway.http.app import create_app
from kiln.gateway.http.edge import EdgeMiddleware, host_name, normalize_origin
from kiln.gateway.settings import Settings

WAIT = 30  # generous bound on every wait; nothing asserts on timing


def _ok_app(entered: list | None = None, release: asyncio.Event | None = None) -> Starlette:
    async def ok(request: Request) -> JSONResponse:
        if entered is not None:
            entered.append(1)
        if release is not None:
            await release.wait()
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/v1/models", ok, methods=["GET", "POST"]), Route("/health", ok, methods=["GET"])])


def _client(app, base_url: str = "http://127.0.0.1:8080") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url, timeout=WAIT)


def _edge(**settings) -> EdgeMiddleware:
    return EdgeMiddleware(_ok_app(), Settings(**settings))


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def _get(app, path: str = "/v1/models", **headers: str) -> httpx.Response:
    async with _client(app) as c:
        return await c.get(path, headers=headers)


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "127.0.0.1", "127.0.0.1:8080", "127.8.9.10:1", "[::1]", "[::1]:8080", "LOCALHOST"])
def test_loopback_hosts_are_answered_in_local_mode(host):
    assert asyncio.run(_get(_edge(), host=host)).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "localhost.evil.example", "192.168.1.5:8080"])
def test_a_foreign_host_is_403_in_local_mode(host):
    error = _error(asyncio.run(_get(_edge(), host=host)), 403, "host_not_allowed")
    assert error["type"] == "permission_error"


def test_allowed_hosts_adds_names_and_star_accepts_any():
    edge = _edge(allowed_hosts=("kiln.lan",))
    assert asyncio.run(_get(edge, host="kiln.lan:8080")).status_code == 200
    assert asyncio.run(_get(edge, host="localhost")).status_code == 200
    _error(asyncio.run(_get(edge, host="other.lan")), 403, "host_not_allowed")
    assert asyncio.run(_get(_edge(allowed_hosts=("*",)), host="anything.example")).status_code == 200


def test_a_public_bind_accepts_any_host_unless_allowed_hosts_is_set():
    assert asyncio.run(_get(_edge(host="0.0.0.0"), host="my-box.lan")).status_code == 200
    _error(asyncio.run(_get(_edge(host="0.0.0.0", allowed_hosts=("kiln.lan",)), host="my-box.lan")), 403, "host_not_allowed")


def test_hosted_mode_skips_the_host_check():
    assert asyncio.run(_get(_edge(auth="keys"), host="api.example.com")).status_code == 200


def test_health_accepts_an_ip_literal_host_for_probes_but_not_a_foreign_name():
    edge = _edge(host="0.0.0.0", allowed_hosts=("kiln.lan",))
    assert asyncio.run(_get(edge, "/health", host="10.1.2.3:8080")).status_code == 200
    _error(asyncio.run(_get(edge, "/health", host="evil.example")), 403, "host_not_allowed")


def test_a_foreign_origin_is_403_in_local_mode_but_loopback_origins_pass():
    _error(asyncio.run(_get(_edge(), origin="https://evil.example")), 403, "origin_not_allowed")
    _error(asyncio.run(_get(_edge(), origin="null")), 403, "origin_not_allowed")
    r = asyncio.run(_get(_edge(), origin="http://localhost:3000"))
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers  # allowed, but not a configured CORS origin


def test_the_origin_rule_holds_on_a_public_bind_too():
    _error(asyncio.run(_get(_edge(host="0.0.0.0"), origin="https://evil.example")), 403, "origin_not_allowed")


def test_a_configured_origin_gets_cors_headers_and_its_preflight_answered():
    edge = _edge(cors_origins=("https://app.example",))
    r = asyncio.run(_get(edge, origin="https://app.example"))
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "origin" in r.headers["vary"].lower()

    async def preflight(origin: str) -> httpx.Response:
        async with _client(edge) as c:
            return await c.options("/v1/responses", headers={
                "origin": origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type, x-stainless-os, openai-organization",
            })

    r = asyncio.run(preflight("https://app.example"))
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os", "openai-organization"} <= allowed
    _error(asyncio.run(preflight("https://evil.example")), 403, "origin_not_allowed")


def test_hosted_mode_does_not_refuse_origins_but_gives_cors_only_to_configured_ones():
    r = asyncio.run(_get(_edge(auth="keys"), origin="https://evil.example"))
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = asyncio.run(_get(_edge(auth="keys", cors_origins=("https://app.example",)), origin="https://app.example"))
    assert r.headers["access-control-allow-origin"] == "https://app.example"


@pytest.mark.parametrize("auth", ["none", "keys"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None])
def test_a_non_json_post_is_415_in_both_modes(auth, content_type):
    async def post() -> httpx.Response:
        async with _client(_edge(auth=auth)) as c:
            headers = {"content-type": content_type} if content_type else {}
            return await c.post("/v1/models", content=b'{"model": "x"}', headers=headers)

    error = _error(asyncio.run(post()), 415, "unsupported_media_type")
    assert error["type"] == "invalid_request_error"


def test_json_posts_and_bodyless_posts_pass():
    async def posts() -> list[int]:
        async with _client(_edge()) as c:
            return [
                (await c.post("/v1/models", json={"model": "x"})).status_code,
                (await c.post("/v1/models", content=b"{}", headers={"content-type": "application/json; charset=utf-8"})).status_code,
                (await c.post("/v1/models")).status_code,
            ]

    assert asyncio.run(posts()) == [200, 200, 200]


def test_a_declared_body_over_the_limit_is_413_before_it_is_read():
    async def post() -> httpx.Response:
        async with _client(_edge(max_body_bytes=100)) as c:
            return await c.post("/v1/models", content=b"{}" + b" " * 200, headers={"content-type": "application/json"})

    _error(asyncio.run(post()), 413, "request_too_large")


def test_requests_over_the_cap_get_503_at_once_and_health_is_not_counted():
    entered: list = []
    release = asyncio.Event()
    edge = EdgeMiddleware(_ok_app(entered, release), Settings(max_connections=2))

    async def scenario() -> tuple[httpx.Response, int, list[int], int]:
        async with _client(edge) as c:
            held = [asyncio.create_task(c.get("/v1/models")) for _ in range(2)]

            async def entered_app(n: int) -> None:
                while len(entered) < n:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(entered_app(2), WAIT)
            over = await asyncio.wait_for(c.post("/v1/models", json={}), WAIT)
            # /health is exempt from the cap: it reaches the app (and waits there like the others).
            probe = asyncio.create_task(c.get("/health"))
            await asyncio.wait_for(entered_app(3), WAIT)
            release.set()
            done = [r.status_code for r in await asyncio.wait_for(asyncio.gather(*held), WAIT)]
            health = (await asyncio.wait_for(probe, WAIT)).status_code
            after = (await c.get("/v1/models")).status_code
            return over, health, done, after

    over, health, done, after = asyncio.run(scenario())
    _error(over, 503, "server_is_overloaded")
    assert over.headers["retry-after"]
    assert health == 200
    assert done == [200, 200]
    assert after == 200  # the slots come back


async def _call(app, method: str, path: str, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, dict[str, str], bytes]:
    """Drive ``app`` by hand: ``chunks`` arrive, then the client stalls (receive never returns)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080),
    }
    pending = list(chunks)
    stall = asyncio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        if pending:
            return {"type": "http.request", "body": pending.pop(0), "more_body": True}
        await stall.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), WAIT)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, body


def test_a_stalled_body_gets_408_through_the_real_app():
    app = create_app(Settings(body_timeout_s=0.2))
    headers = {"host": "127.0.0.1:8080", "content-type": "application/json", "content-length": "1000"}
    status, response_headers, body = asyncio.run(_call(app, "POST", "/v1/responses", headers, [b'{"mod']))
    assert status == 408
    assert response_headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_stalled_body_gets_408_whoever_reads_it():
    async def raw_reader(scope, receive, send) -> None:
        while True:  # a reader with no ApiError handler: the middleware answers for it
            message = await receive()
            if not message.get("more_body"):
                break

    edge = EdgeMiddleware(raw_reader, Settings(body_timeout_s=0.2))
    headers = {"host": "localhost", "content-type": "application/json", "content-length": "1000"}
    status, response_headers, body = asyncio.run(_call(edge, "POST", "/v1/responses", headers, [b"{", b'"a']))
    assert status == 408
    assert response_headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("value,name", [("localhost:8080", "localhost"), ("[::1]:80", "::1"), ("Example.COM.", "example.com"), ("127.0.0.1", "127.0.0.1")])
def test_host_name(value, name):
    assert host_name(value) == name


@pytest.mark.parametrize("value,origin", [("https://App.example/", "https://app.example"), ("http://localhost:3000", "http://localhost:3000"), ("null", None), ("file://", None)])
def test_normalize_origin(value, origin):
    assert normalize_origin(value) == origin


def test_bodies_past_the_buffer_budget_get_503_and_the_budget_comes_back():
    async def raw_reader(scope, receive, send) -> None:
        while True:
            message = await receive()
            if not message.get("more_body"):
                break

    edge = EdgeMiddleware(raw_reader, Settings(body_timeout_s=1, body_buffer_bytes=1000))
    headers = {"host": "localhost", "content-type": "application/json", "content-length": "5000"}

    async def scenario():
        first = asyncio.create_task(_call(edge, "POST", "/v1/responses", headers, [b"x" * 600]))

        async def holding() -> None:
            while edge.body_budget.used < 600:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(holding(), WAIT)
        second = await _call(edge, "POST", "/v1/responses", headers, [b"x" * 600])
        return await first, second

    first, second = asyncio.run(scenario())
    assert first[0] == 408  # the stalled holder still meets its deadline
    assert second[0] == 503 and second[1]["retry-after"]
    assert json.loads(second[2])["error"]["code"] == "server_is_overloaded"
    assert edge.body_budget.used == 0


def test_an_answer_before_the_body_is_read_closes_the_connection():
    """A refusal sent before the body arrived (as the accounts middleware's 401 is) says
    ``Connection: close``: Hypercorn closes such a connection anyway, and a client told nothing
    could send its next request into it. Answers after the body, and bodiless requests, keep it."""

    async def refuse_unread(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def read_then_answer(scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    posted = {"host": "localhost", "content-type": "application/json", "content-length": "2"}
    _, refused, _ = asyncio.run(_call(EdgeMiddleware(refuse_unread, Settings()), "POST", "/v1/responses", posted, [b"{}"]))
    assert refused.get("connection") == "close"
    _, bodiless, _ = asyncio.run(_call(EdgeMiddleware(refuse_unread, Settings()), "GET", "/v1/models", {"host": "localhost"}, []))
    assert "connection" not in bodiless

    async def one_chunk_then_end(app, headers):
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"", "root_path": "", "headers": [(k.encode(), v.encode()) for k, v in headers.items()], "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080)}
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        await asyncio.wait_for(app(scope, receive, send), WAIT)
        start = next(m for m in sent if m["type"] == "http.response.start")
        return {k.decode().lower(): v.decode() for k, v in start["headers"]}

    assert "connection" not in asyncio.run(one_chunk_then_end(EdgeMiddleware(read_then_answer, Settings()), posted))


def test_a_401_on_a_posted_body_closes_the_connection_in_hosted_mode(tmp_path):
    from tests.gateway.inprocess import hosted_app

    async def go() -> tuple[httpx.Response, httpx.Response]:
        app, _pool, key = await hosted_app(tmp_path)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8080") as c:
                refused = await c.post("/v1/responses", json={"model": "m", "input": "x"}, headers={"Authorization": "Bearer sk-kiln-nonsense"})
                listed = await c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                return refused, listed
        finally:
            await app.state.accounts.close()

    refused, listed = asyncio.run(go())
    assert refused.status_code == 401 and refused.headers.get("connection") == "close"
    assert listed.status_code == 200 and "connection" not in listed.headers
