"""Who is calling: ``Authorization: Bearer <key>`` -> a Principal, or an OpenAI-shaped refusal.

Checks, in order: a key is present, known and not revoked (401 ``invalid_api_key``); the key may use
the requested model (403 ``model_not_allowed``); the organization has credits left (402
``insufficient_quota``). Lookups are cached for ``cache_ttl`` seconds (default 2) so a busy
organization costs one indexed query per key per TTL, while a revocation still takes effect within
that time, on every replica, with no invalidation messages. The cached balance only answers
``require_credits`` here; metered requests are admitted on the live balance (admission.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import select

from kiln.gateway.http.errors import ApiError

from .db import Database
from .keys import decode_models, hash_key
from .schema import api_keys, organizations


@dataclass(frozen=True)
class Principal:
    """The authenticated caller, as the rest of the gateway needs it."""

    org_id: int
    org_name: str
    key_prefix: str
    concurrency_limit: int
    # The models this key may use; None for every model in the catalog.
    allowed_models: tuple[str, ...] | None = None


@dataclass(frozen=True)
class _KeyRecord:
    principal: Principal
    revoked: bool
    credits_nanousd: int


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def parse_bearer(authorization_header: str | None) -> str:
    """The key from an Authorization header, or a 401 explaining what is wrong with it."""
    if not authorization_header or not authorization_header.strip():
        raise _unauthorized("You didn't provide an API key. Send it in the Authorization header as 'Bearer <key>'.")
    scheme, _, key = authorization_header.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise _unauthorized("Malformed Authorization header: expected 'Bearer <key>'.")
    return key


class Authenticator:
    """Turns an Authorization header into a Principal; raises ApiError 401/402/403."""

    def __init__(self, db: Database, *, cache_ttl: float = 2.0, cache_size: int = 10_000) -> None:
        self._db = db
        self._ttl = cache_ttl
        self._size = cache_size
        self._cache: dict[str, tuple[float, _KeyRecord | None]] = {}

    async def authenticate(self, authorization_header: str | None, model: str | None, *, require_credits: bool = True) -> Principal:
        """Authenticate a request.

        ``model`` is checked against the key's allowed models when given (None for endpoints that
        name no model). ``require_credits=False`` lets an organization with no credit left still
        read its own usage.
        """
        key = parse_bearer(authorization_header)
        record = await self._lookup(hash_key(key))
        if record is None or record.revoked:
            raise _unauthorized("Incorrect API key provided, or the key has been revoked.")
        allowed = record.principal.allowed_models
        if model is not None and allowed is not None and model not in allowed:
            raise ApiError(403, f"This API key is not allowed to use the model '{model}'.", code="model_not_allowed", param="model")
        if require_credits and record.credits_nanousd <= 0:
            raise ApiError(402, "Your organization has no credits left. Add credits to continue.", code="insufficient_quota")
        return record.principal

    def invalidate(self) -> None:
        """Forget cached lookups (after an admin change made in this process)."""
        self._cache.clear()

    async def _lookup(self, key_hash: str) -> _KeyRecord | None:
        now = time.monotonic()
        cached = self._cache.get(key_hash)
        if cached is not None and cached[0] > now:
            return cached[1]
        record = await self._query(key_hash)
        if self._ttl > 0:
            if len(self._cache) >= self._size:
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                if len(self._cache) >= self._size:
                    self._cache.clear()
            self._cache[key_hash] = (now + self._ttl, record)
        return record

    async def _query(self, key_hash: str) -> _KeyRecord | None:
        query = (
            select(
                organizations.c.id,
                organizations.c.name,
                organizations.c.concurrency_limit,
                organizations.c.credits_nanousd,
                api_keys.c.prefix,
                api_keys.c.allowed_models,
                api_keys.c.revoked,
            )
            .join(organizations, organizations.c.id == api_keys.c.org_id)
            .where(api_keys.c.key_hash == key_hash)
        )
        async with self._db.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        if row is None:
            return None
        principal = Principal(org_id=row.id, org_name=row.name, key_prefix=row.prefix, concurrency_limit=row.concurrency_limit, allowed_models=decode_models(row.allowed_models))
        return _KeyRecord(principal=principal, revoked=bool(row.revoked), credits_nanousd=row.credits_nanousd)
