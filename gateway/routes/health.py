"""``GET /health``: ready once at least one worker is registered."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


async def health(request: Request) -> Response:
    pool = request.app.state.pool
    workers = [
        {"id": w.info.worker_id, "model": w.info.model, "active": w.active, "queued": w.queued, "cache": w.cache}
        for w in pool.workers.values()
    ]
    status = 200 if workers else 503
    # With --store redis the figures are the deployment's, and a Redis that is down shows as
    # "available": false without failing the check: requests that need no store still work.
    stores = await request.app.state.responses.stats()
    return JSONResponse({"status": "ok" if workers else "no_workers", "workers": workers, "stores": stores}, status_code=status)
