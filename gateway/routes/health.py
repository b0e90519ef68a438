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
    service = request.app.state.responses
    store = service.store
    stores = {
        "responses": {"entries": len(store), "bytes": store.bytes, "max_bytes": store.max_bytes} if store is not None else None,
        "background": {"active": len(service.jobs.active), "active_bytes": service.jobs.active_bytes},
    }
    return JSONResponse({"status": "ok" if workers else "no_workers", "workers": workers, "stores": stores}, status_code=status)
