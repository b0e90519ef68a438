"""The opt-in request log survives hostile bodies and is readable by its owner only."""

from __future__ import annotations

import os
import stat

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kiln.gateway.http.request_log import RequestLogMiddleware, read_log


async def _answer(request):
    await request.body()
    return JSONResponse({"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}, status_code=400)


def test_deeply_nested_body_is_logged_without_failing_the_request(tmp_path):
    path = tmp_path / "requests.jsonl"
    old = os.umask(0o022)
    try:
        app = Starlette(routes=[Route("/v1/responses", _answer, methods=["POST"])])
        app.add_middleware(RequestLogMiddleware, path=str(path), bodies=True)
        with TestClient(app) as client:
            r = client.post("/v1/responses", content=b'{"input":' + b"[" * 100_000)
            assert r.status_code == 400  # the route's own answer, not a 500 from the log
            assert client.post("/v1/responses", json={"model": "m", "input": "hi"}).status_code == 400
    finally:
        os.umask(old)
    entries = read_log(path)
    assert len(entries) == 2 and all(e["status"] == 400 for e in entries)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
