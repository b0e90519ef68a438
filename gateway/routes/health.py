"""``GET /health``: ready once at least one worker is registered, or, under ``kiln serve`` with
on-demand models, as soon as it can start them (there is nothing to wait for before a request)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


async def health(request: Request) -> Response:
    pool = request.app.state.pool
    workers = [
        {"id": w.info.worker_id, "model": w.info.model, "pid": w.info.pid, "rss_bytes": w.rss_bytes, "active": w.active, "queued": w.queued, "cache": w.cache}
        for w in pool.workers.values()
    ]
    ready = bool(workers) or request.app.state.loader.can_load
    status = 200 if ready else 503
    service = request.app.state.responses
    store = service.store
    stores = {
        "responses": {"entries": len(store), "bytes": store.bytes, "max_bytes": store.max_bytes} if store is not None else None,
        "background": {"active": len(service.jobs.active), "active_bytes": service.jobs.active_bytes},
    }
    return JSONResponse({"status": "ok" if ready else "no_workers", "workers": workers, "stores": stores}, status_code=status)
