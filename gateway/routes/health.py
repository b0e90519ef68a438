"""``GET /health``: ready once at least one worker is registered, or, under ``kiln serve`` with
on-demand models, as soon as it can start them (there is nothing to wait for before a request).

It is open to anyone, so it names no worker id or pid: each worker shows as a ``tag``, a digest of
its id that tells workers apart (the same on every replica) and reveals nothing to claim."""

from __future__ import annotations

import hashlib

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


def worker_tag(worker_id: str) -> str:
    return hashlib.sha256(b"kiln worker tag " + worker_id.encode()).hexdigest()[:16]


async def health(request: Request) -> Response:
    pool = request.app.state.pool
    workers = [
        {"tag": worker_tag(w.info.worker_id), "model": w.info.model, "rss_bytes": w.rss_bytes, "active": w.active, "queued": w.queued, "cache": w.cache}
        for w in pool.workers.values()
    ]
    ready = bool(workers) or request.app.state.loader.can_load
    status = 200 if ready else 503
    # With --store redis the figures are the deployment's, and a Redis that is down shows as
    # "available": false without failing the check: requests that need no store still work.
    stores = await request.app.state.responses.stats()
    return JSONResponse({"status": "ok" if ready else "no_workers", "workers": workers, "stores": stores}, status_code=status)
