"""The admin API the operator console drives (mounted only with ``--auth keys``).

Every route needs ``Authorization: Bearer <admin token>`` (404 when no admin token is configured,
401 without it: ``usage._require_admin``), and the accounts middleware lets ``/admin/...`` through
without an API key. A browser never sends that header by itself (it is no cookie), so a page on
another site cannot ride on a signed-in console; and each state-changing call must also come from
this gateway's own origin (or one of ``--cors-origins``) when it names one, as a second fence.

- ``GET /admin/orgs``; ``POST /admin/orgs`` ``{"name", "credits_usd", "concurrency_limit"}``
- ``POST /admin/orgs/{name}/credits`` ``{"amount_usd"}``: top up (a negative amount removes)
- ``GET /admin/orgs/{name}/keys``; ``POST /admin/orgs/{name}/keys`` ``{"models": [..] | null}``: the
  new key is in the answer once (``no-store``)
- ``POST /admin/keys/{prefix}/revoke``: by the visible prefix only, so no whole key is put in a URL
- ``GET /admin/catalog``: the models with their prices and whether a worker serves them now
- ``GET /admin/usage?start_time&end_time&bucket``: the ledger per bucket, organization and model

The same operations as ``kiln orgs`` and ``kiln keys`` (kiln/admin.py), on the same functions.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...accounts.exceptions import AlreadyExists, NotFound
from ...accounts.keys import KEY_SCHEME, ApiKeyInfo, create_key, key_prefix, list_keys, revoke_key
from ...accounts.orgs import DEFAULT_CONCURRENCY_LIMIT, Organization, create_org, credit_org, list_orgs
from ...accounts.usage_series import usage_series
from ..body import read_json
from ..edge import EdgePolicy, normalize_origin
from ..errors import ApiError, invalid
from .usage import MAX_TIMESTAMP, _catalog_model, _int_param, _require_admin

T = TypeVar("T")
MAX_ADMIN_BODY = 1 << 16
MAX_USD = Decimal(10) ** 9  # one call moves at most a billion dollars: a typo, not a top-up
MAX_CONCURRENCY = 100_000
MAX_MODELS = 256


def _db(request: Request) -> Any:
    _require_admin(request)
    return request.app.state.accounts.db


def _require_same_origin(request: Request) -> None:
    """Refuse a state change whose ``Origin`` is neither this gateway nor a configured one (403)."""
    origin = request.headers.get("origin")
    if origin is None:  # not a browser (curl, the SDKs): the bearer token is the whole check
        return
    normalized = normalize_origin(origin)
    host = (request.headers.get("host") or "").strip().lower()
    if normalized is not None and urlsplit(normalized).netloc == host:
        return
    if EdgePolicy.from_settings(request.app.state.settings).cors_allowed(origin):
        return
    raise ApiError(403, "Admin changes are accepted only from this gateway's own pages.", code="permission_denied")


def _changing(request: Request) -> Any:
    db = _db(request)
    _require_same_origin(request)
    return db


async def _body(request: Request) -> dict[str, Any]:
    body = await read_json(request, MAX_ADMIN_BODY)
    if not isinstance(body, dict):
        raise invalid("Expected a JSON object.")
    return body


def _usd(value: Any, param: str) -> Decimal:
    """A USD amount given as a JSON number or a decimal string, read exactly."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise invalid(f"'{param}' must be a USD amount (a number or a decimal string).", param=param)
    try:
        amount = Decimal(str(value).strip().lstrip("$"))
    except InvalidOperation:
        amount = None
    if amount is None or not amount.is_finite() or abs(amount) > MAX_USD:
        raise invalid(f"'{param}' must be a USD amount within ±{MAX_USD}.", param=param)
    return amount


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise invalid("'name' must be a non-empty string of at most 200 characters.", param="name")
    return value.strip()


def _org_json(org: Organization) -> dict[str, Any]:
    return {
        "object": "organization",
        "name": org.name,
        "credits_usd": str(org.credits_usd),
        "concurrency_limit": org.concurrency_limit,
        "created_at": int(org.created_at.timestamp()),
    }


def _key_json(info: ApiKeyInfo) -> dict[str, Any]:
    return {
        "object": "api_key",
        "prefix": info.prefix,
        "org": info.org_name,
        "models": list(info.allowed_models) if info.allowed_models is not None else None,
        "revoked": info.revoked,
        "created_at": int(info.created_at.timestamp()),
    }


async def _found(lookup: Awaitable[T]) -> T:
    """``lookup``'s result; an unknown organization or key is a 404."""
    try:
        return await lookup
    except NotFound as exc:
        raise ApiError(404, str(exc), code="not_found") from None


async def get_orgs(request: Request) -> Response:
    orgs = await list_orgs(_db(request))
    return JSONResponse({"object": "list", "data": [_org_json(o) for o in orgs]})


async def post_orgs(request: Request) -> Response:
    db = _changing(request)
    body = await _body(request)
    limit = body.get("concurrency_limit", DEFAULT_CONCURRENCY_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_CONCURRENCY:
        raise invalid(f"'concurrency_limit' must be an integer from 1 to {MAX_CONCURRENCY}.", param="concurrency_limit")
    try:
        org = await create_org(db, _name(body.get("name")), credits_usd=_usd(body.get("credits_usd", 0), "credits_usd"), concurrency_limit=limit)
    except AlreadyExists as exc:
        raise ApiError(409, str(exc), code="conflict") from None
    return JSONResponse(_org_json(org), status_code=201)


async def post_credits(request: Request) -> Response:
    db = _changing(request)
    amount = _usd((await _body(request)).get("amount_usd"), "amount_usd")
    org = await _found(credit_org(db, request.path_params["name"], amount))
    return JSONResponse(_org_json(org))


async def get_keys(request: Request) -> Response:
    keys = await _found(list_keys(_db(request), request.path_params["name"]))
    return JSONResponse({"object": "list", "data": [_key_json(k) for k in keys]})


async def post_keys(request: Request) -> Response:
    db = _changing(request)
    models = (await _body(request)).get("models")
    if models is not None and (not isinstance(models, list) or not models or len(models) > MAX_MODELS or not all(isinstance(m, str) and m.strip() for m in models)):
        raise invalid(f"'models' must be null (every model) or a list of 1 to {MAX_MODELS} model ids.", param="models")
    new = await _found(create_key(db, request.path_params["name"], models=models))
    return JSONResponse({**_key_json(new.info), "key": new.key}, status_code=201, headers={"Cache-Control": "no-store"})


async def post_revoke(request: Request) -> Response:
    db = _changing(request)
    prefix = request.path_params["prefix"]
    if not prefix.startswith(KEY_SCHEME) or key_prefix(prefix) != prefix:
        raise invalid(f"Revoke by the key's visible prefix ({KEY_SCHEME} and 8 characters), never the whole key.", param="prefix")
    info = await _found(revoke_key(db, prefix))
    accounts = request.app.state.accounts
    if accounts.auth is not None:
        accounts.auth.invalidate()  # this replica refuses it at once; others within the cache TTL
    return JSONResponse(_key_json(info))


async def get_catalog(request: Request) -> Response:
    _require_admin(request)
    accounts = request.app.state.accounts
    if accounts.catalog is not None:
        return JSONResponse({"object": "list", "priced": True, "data": [_catalog_model(request, m) for m in accounts.catalog.models()]})
    served = sorted({w.info.model for w in request.app.state.pool.workers.values()})
    return JSONResponse({"object": "list", "priced": False, "data": [{"id": m, "object": "model", "available": True, "pricing": None} for m in served]})


async def get_usage_series(request: Request) -> Response:
    db = _db(request)
    now = int(time.time())
    end = _int_param(request, "end_time", 1, MAX_TIMESTAMP, now + 1)
    assert end is not None  # it has a default
    start = _int_param(request, "start_time", 0, MAX_TIMESTAMP, max(0, end - 3600))
    bucket = _int_param(request, "bucket", 1, 31 * 86_400, 60)
    assert start is not None and end is not None and bucket is not None
    try:
        points, truncated = await usage_series(db, start=start, end=end, bucket_s=bucket)
    except ValueError as exc:
        raise invalid(f"{exc}.", param="bucket") from None
    return JSONResponse({"object": "usage.series", "start_time": start, "end_time": end, "bucket": bucket, "truncated": truncated, "data": [p.to_json() for p in points]})


ROUTES = [
    Route("/admin/orgs", get_orgs, methods=["GET"]),
    Route("/admin/orgs", post_orgs, methods=["POST"]),
    Route("/admin/orgs/{name}/credits", post_credits, methods=["POST"]),
    Route("/admin/orgs/{name}/keys", get_keys, methods=["GET"]),
    Route("/admin/orgs/{name}/keys", post_keys, methods=["POST"]),
    Route("/admin/keys/{prefix}/revoke", post_revoke, methods=["POST"]),
    Route("/admin/catalog", get_catalog, methods=["GET"]),
    Route("/admin/usage", get_usage_series, methods=["GET"]),
]
