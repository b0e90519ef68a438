"""The hosted mode's own routes (mounted only with ``--auth keys``).

- ``GET /v1/usage``: the calling organization's usage events, oldest first, paginated
  (``limit``, ``after``), filtered by ``start_time``/``end_time`` (unix seconds, half-open) and
  ``model``. The middleware has already authenticated the key (credits not required).
- ``GET /v1/models`` and ``GET /v1/models/{id}`` when a catalog is loaded: the catalog's models with
  their prices (USD per million tokens) and whether a worker serves them now.
- ``GET|POST /admin/maintenance``: the maintenance switch, guarded by ``--admin-token``; while on,
  every API route answers 503 with ``Retry-After`` (1 to 86400 seconds).

Every query value is range-checked here, so that no value reaches the database layer (or
``datetime``) out of range: times from 0 to the end of year 9999, ``limit`` 1 to ``MAX_PAGE``.
"""

from __future__ import annotations

import hmac
import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...accounts.auth import Principal
from ...accounts.catalog import Catalog
from ...accounts.metering import MAX_PAGE
from ...accounts.middleware import PRINCIPAL_SCOPE_KEY
from ...accounts.service import Accounts
from ..body import read_json
from ..errors import ApiError, invalid


def _accounts(request: Request) -> Accounts:
    accounts: Accounts = request.app.state.accounts
    return accounts


def _catalog(request: Request) -> Catalog:
    catalog = _accounts(request).catalog
    if catalog is None:  # only reachable if a route were installed without a catalog
        raise ApiError(404, "Not Found", code="not_found")
    return catalog


def _principal(request: Request) -> Principal:
    principal: Principal | None = request.scope.get(PRINCIPAL_SCOPE_KEY)
    if principal is None:  # only reachable if the middleware is not installed
        raise ApiError(401, "Authentication required.", code="invalid_api_key")
    return principal


# 9999-12-31T23:59:59Z, the last second a datetime can hold.
MAX_TIMESTAMP = 253_402_300_799
MAX_RETRY_AFTER = 86_400
_INTEGER = re.compile(r"[+-]?[0-9]{1,30}")


def _int_param(request: Request, name: str, low: int, high: int, default: int | None = None) -> int | None:
    """An optional integer query parameter within ``low``..``high`` (400 otherwise)."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    shown = raw if len(raw) <= 40 else raw[:37] + "..."
    if not _INTEGER.fullmatch(raw):  # also keeps 5,000-digit strings away from int()
        raise invalid(f"'{name}' must be an integer, got {shown!r}.", param=name)
    value = int(raw)
    if not low <= value <= high:
        raise invalid(f"'{name}' must be an integer from {low} to {high}, got {shown}.", param=name)
    return value


_TEXT = re.compile(r"[^\x00-\x1f\x7f]{1,200}")  # no control characters (PostgreSQL refuses NUL)


def _text_param(request: Request, name: str) -> str | None:
    """An optional text query parameter: at most 200 characters (a model id's column), no
    control characters (400 otherwise)."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    if not _TEXT.fullmatch(raw):
        raise invalid(f"'{name}' must be at most 200 characters without control characters.", param=name)
    return raw


async def get_usage(request: Request) -> Response:
    principal = _principal(request)
    meter = _accounts(request).meter
    if meter is None:  # only before the accounts have started, which the app awaits
        raise ApiError(503, "Usage is not available yet.", headers={"Retry-After": "1"})
    page = await meter.list_usage(
        principal.org_id,
        after_ts=_int_param(request, "start_time", 0, MAX_TIMESTAMP),
        before_ts=_int_param(request, "end_time", 0, MAX_TIMESTAMP),
        model=_text_param(request, "model"),
        limit=_int_param(request, "limit", 1, MAX_PAGE) or 100,
        after_id=_text_param(request, "after"),
    )
    return JSONResponse(page.to_json())


def _catalog_model(request: Request, model: str) -> dict[str, Any]:
    price = _catalog(request).require(model)
    pool = request.app.state.pool
    return {
        "id": model,
        "object": "model",
        "created": request.app.state.started_at,
        "owned_by": "kiln",
        "available": pool.resolve(model) is not None,
        "pricing": {
            "currency": "USD",
            "unit": "1M tokens",
            "input": float(price.input_per_million),
            "cached_input": float(price.cached_input_per_million),
            "output": float(price.output_per_million),
        },
    }


async def list_catalog_models(request: Request) -> Response:
    models = _catalog(request).models()
    return JSONResponse({"object": "list", "data": [_catalog_model(request, m) for m in models]})


async def get_catalog_model(request: Request) -> Response:
    return JSONResponse(_catalog_model(request, request.path_params["model"]))


def _require_admin(request: Request) -> None:
    token = _accounts(request).admin_token
    if token is None:
        raise ApiError(404, "Not Found", code="not_found")
    scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "A valid admin token is required.", code="invalid_api_key")


async def maintenance(request: Request) -> Response:
    from ...store.redis.connection import BACKEND_ERRORS

    _require_admin(request)
    try:
        return await _maintenance(request, _accounts(request))
    except BACKEND_ERRORS:  # the switch is shared through Redis, which did not answer
        raise ApiError(503, "The maintenance switch is unavailable. Retry with exponential backoff.", headers={"Retry-After": "2"}) from None


async def _maintenance(request: Request, accounts: Accounts) -> Response:
    if request.method == "POST":
        body = await read_json(request, 1 << 16)
        if not isinstance(body, dict) or not isinstance(body.get("on"), bool):
            raise invalid("Expected {\"on\": true|false, \"retry_after\": seconds}.", param="on")
        retry_after = body.get("retry_after", (await accounts.maintenance.state())[1])
        if isinstance(retry_after, bool) or not isinstance(retry_after, int) or not 1 <= retry_after <= MAX_RETRY_AFTER:
            raise invalid(f"'retry_after' must be an integer number of seconds from 1 to {MAX_RETRY_AFTER}.", param="retry_after")
        await accounts.maintenance.set(body["on"], retry_after)
    on, retry_after = await accounts.maintenance.state()
    return JSONResponse({"maintenance": on, "retry_after": retry_after})


def hosted_routes(accounts: Accounts) -> list[Route]:
    """Routes to put in front of the app's own (the first match wins)."""
    routes = [Route("/admin/maintenance", maintenance, methods=["GET", "POST"])]
    for prefix in ("/v1", ""):
        routes.append(Route(prefix + "/usage", get_usage, methods=["GET"]))
        if accounts.catalog is not None:
            routes.append(Route(prefix + "/models", list_catalog_models, methods=["GET"]))
            routes.append(Route(prefix + "/models/{model:path}", get_catalog_model, methods=["GET"]))
    return routes
