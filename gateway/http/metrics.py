"""Prometheus metrics for ``GET /metrics``.

Request counts and in-flight come from a thin ASGI wrapper; time to first token, inter-token gaps
and token counts from the generation path; worker load and prefix-cache hit ratio are read from the
pool's heartbeat figures at scrape time, so they cost nothing between scrapes. Workers are
labelled by the tag ``/health`` shows (a digest of the id), never by the id itself.

Access: in local mode ``/metrics`` is open (the gateway listens on loopback). In hosted mode
(``app.state.accounts`` set) the figures are the operator's, not a tenant's, so ``/metrics`` needs
the admin token (``Authorization: Bearer <admin token>``): a tenant key gets 403, anything else 401.
The wrapper answers ``/metrics`` itself in hosted mode, ahead of the accounts middleware, which
would otherwise refuse the admin token as an unknown API key.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import Response

from kiln.protocol.events import WorkerEvent
from kiln.protocol.usage import Usage

from .errors import ApiError
from .routes.health import worker_tag

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, pool: Any) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kiln_requests", "HTTP requests by route and status.", ["route", "status"], registry=self.registry)
        self.in_flight = Gauge("kiln_requests_in_flight", "HTTP requests being served.", registry=self.registry)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "From sending to a worker to the first output event.", buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("kiln_inter_token_seconds", "Gaps between consecutive output deltas.", buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tokens = Counter("kiln_tokens", "Tokens by direction (input, cached, output).", ["direction"], registry=self.registry)
        self.registry.register(_WorkerCollector(pool))

    def observe_usage(self, usage: dict[str, Any]) -> None:
        counts = Usage.from_map(usage)
        self.tokens.labels("input").inc(counts.input_tokens)
        self.tokens.labels("cached").inc(counts.cached_tokens)
        self.tokens.labels("output").inc(counts.output_tokens)


class _WorkerCollector:
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        routed = CounterMetricFamily("kiln_worker_requests", "Requests the gateway sent to each worker (routing decisions).", labels=["worker", "model"])
        active = GaugeMetricFamily("kiln_worker_active", "Requests decoding on each worker.", labels=["worker", "model"])
        queued = GaugeMetricFamily("kiln_worker_queue_depth", "Requests waiting on each worker.", labels=["worker", "model"])
        ratio = GaugeMetricFamily("kiln_worker_cache_hit_ratio", "Prefix-cache hits over lookups on each worker.", labels=["worker", "model"])
        # Speculative decoding: decode_tokens / decode_steps is the tokens a request gets per step.
        counts = {
            key: CounterMetricFamily(f"kiln_worker_{name}", text, labels=["worker", "model"])
            for key, name, text in (
                ("decode_tokens", "decode_tokens", "Tokens decoded on each worker."),
                ("decode_row_steps", "decode_steps", "Decode steps on each worker, counted per request stepped."),
                ("draft_tokens", "draft_tokens", "Prompt-lookup draft tokens verified on each worker."),
                ("accepted_draft_tokens", "accepted_draft_tokens", "Of those, the drafts kept."),
            )
        }
        for w in list(self.pool.workers.values()):
            # The tag /health shows, never the id: an id is what a rogue worker would claim.
            labels = [worker_tag(w.info.worker_id), w.info.model]
            routed.add_metric(labels, w.routed)
            active.add_metric(labels, w.active)
            queued.add_metric(labels, w.queued)
            lookups = w.cache.get("cache_lookups") or 0
            ratio.add_metric(labels, (w.cache.get("cache_hits") or 0) / lookups if lookups else 0.0)
            for key, family in counts.items():
                family.add_metric(labels, w.cache.get(key) or 0)
        yield routed
        yield active
        yield queued
        yield ratio
        yield from counts.values()


class GenerationTimer:
    """Times one generation's events for the TTFT and inter-token histograms."""

    def __init__(self, metrics: Metrics | None) -> None:
        self.metrics = metrics
        self.started = time.monotonic()
        self.last: float | None = None

    def event(self, event: WorkerEvent) -> None:
        if self.metrics is None or not event.get("type", "").endswith(".delta"):
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.started)
        else:
            self.metrics.inter_token.observe(now - self.last)
        self.last = now


class MetricsMiddleware:
    """Counts requests by route template and status, and tracks in-flight requests."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics" and scope.get("method") in ("GET", "HEAD"):
            app = scope.get("app")
            if app is not None and getattr(app.state, "accounts", None) is not None:
                response = await metrics_endpoint(Request(scope, receive))
                await response(scope, receive, send)
                return
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, capture)
        finally:
            self.metrics.in_flight.dec()
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, str(status["code"])).inc()


async def _bearer_is_tenant_key(accounts: Any, authorization: str) -> bool:
    try:
        await accounts.auth.authenticate(authorization, None, require_credits=False)
    except Exception:  # not a key (ApiError), or the accounts backend is down: not a tenant
        return False
    return True


async def require_admin(request: Request) -> None:
    """In hosted mode, refuse ``/metrics`` without the admin token (401; 403 for a tenant key)."""
    accounts = request.app.state.accounts
    if accounts is None:
        return
    authorization = request.headers.get("authorization") or ""
    scheme, _, given = authorization.partition(" ")
    token = accounts.admin_token
    if token is not None and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return
    if scheme.lower() == "bearer" and given.strip() and await _bearer_is_tenant_key(accounts, authorization):
        raise ApiError(403, "/metrics needs the admin token; an API key cannot read it.", code="permission_denied")
    raise ApiError(401, "/metrics needs a valid admin token (Authorization: Bearer <admin token>).", code="invalid_api_key")


async def metrics_endpoint(request: Request) -> Response:
    try:
        await require_admin(request)
    except ApiError as error:
        return error.response()
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
