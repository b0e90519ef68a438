"""``GET /health``: up once at least one worker is registered, or, under ``kiln serve`` with
on-demand models, as soon as it can start them (there is nothing to wait for before a request).

The status code is what load balancers and Kubernetes probes read (deploy/): 200 while this
gateway can serve something. ``ready`` says more: every model the deployment starts with (the
command line's, or the config's ``load = "always"`` ones) has had a worker register, so a request
for any of them would be served; ``loading`` lists those still waiting for their first worker
(their requests get 503 ``model_loading``). ``kiln serve`` prints its ready line on ``ready``.

It is open to anyone, so it names no worker id or pid: each worker shows as a ``tag``, a digest of
its id that tells workers apart (the same on every replica) and reveals nothing to claim.
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


def worker_tag(worker_id: str) -> str:
    return hashlib.sha256(b"kiln worker tag " + worker_id.encode()).hexdigest()[:16]


async def health(request: Request) -> Response:
    pool = request.app.state.pool
    loader = request.app.state.loader
    workers = [
        {"tag": worker_tag(w.info.worker_id), "model": w.info.model, "rss_bytes": w.rss_bytes, "active": w.active, "queued": w.queued, "cache": w.cache}
        for w in pool.workers.values()
    ]
    up = bool(workers) or loader.can_load
    loading = loader.loading()
    status = 200 if up else 503
    # With --store redis the figures are the deployment's, and a Redis that is down shows as
    # "available": false without failing the check: requests that need no store still work.
    stores = await request.app.state.responses.stats()
    body = {"status": "ok" if up else "no_workers", "ready": up and not loading, "loading": loading, "workers": workers, "stores": stores}
    return JSONResponse(body, status_code=status)
