"""API keys: minted once, shown once, stored only as a SHA-256 hash plus a visible prefix.

Keys carry about 200 bits of randomness, so a fast hash is enough (no password-style stretching):
nobody can enumerate the key space, and the request path stays one indexed lookup. The prefix
(``sk-kiln-`` and the first 8 random characters) is what support and ``keys revoke`` use.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Row
from sqlalchemy.exc import IntegrityError

from .db import Database
from .exceptions import NotFound
from .orgs import get_org
from .schema import api_keys, organizations, utcnow

KEY_SCHEME = "sk-kiln-"
_ALPHABET = string.ascii_lowercase + string.digits
_RANDOM_LENGTH = 40  # 40 * log2(36) ~ 206 bits
_VISIBLE_LENGTH = 8


@dataclass(frozen=True)
class ApiKeyInfo:
    prefix: str
    org_name: str
    allowed_models: tuple[str, ...] | None
    revoked: bool
    created_at: datetime


@dataclass(frozen=True)
class NewKey:
    key: str  # the secret; shown once, never stored
    info: ApiKeyInfo


def generate_key() -> str:
    return KEY_SCHEME + "".join(secrets.choice(_ALPHABET) for _ in range(_RANDOM_LENGTH))


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_prefix(key: str) -> str:
    return key[: len(KEY_SCHEME) + _VISIBLE_LENGTH]


def encode_models(models: list[str] | tuple[str, ...] | None) -> str | None:
    if models is None:
        return None
    cleaned = sorted({m.strip() for m in models if m.strip()})
    if not cleaned:
        raise ValueError("the allowed model list is empty; omit it to allow every model")
    return json.dumps(cleaned)


def decode_models(stored: str | None) -> tuple[str, ...] | None:
    return None if stored is None else tuple(json.loads(stored))


async def create_key(db: Database, org_name: str, *, models: list[str] | tuple[str, ...] | None = None) -> NewKey:
    """Mint a key for an organization, optionally limited to some model ids."""
    org = await get_org(db, org_name)
    allowed = encode_models(models)
    for _ in range(5):  # a prefix collision is rare (36^8); draw again if it happens
        key = generate_key()
        created_at = utcnow()
        try:
            async with db.engine.begin() as conn:
                await conn.execute(
                    api_keys.insert().values(
                        org_id=org.id,
                        prefix=key_prefix(key),
                        key_hash=hash_key(key),
                        allowed_models=allowed,
                        revoked=False,
                        created_at=created_at,
                    )
                )
        except IntegrityError:
            continue
        info = ApiKeyInfo(key_prefix(key), org.name, decode_models(allowed), False, created_at)
        return NewKey(key=key, info=info)
    raise RuntimeError("could not draw a unique key prefix")


def _info_query(where: Any) -> Any:
    """The ``ApiKeyInfo`` columns of the keys ``where`` selects, with their organization's name."""
    columns = (api_keys.c.prefix, organizations.c.name, api_keys.c.allowed_models, api_keys.c.revoked, api_keys.c.created_at)
    return select(*columns).join(organizations, organizations.c.id == api_keys.c.org_id).where(where)


def _info(row: Row[Any, Any, Any, Any, Any]) -> ApiKeyInfo:
    return ApiKeyInfo(
        prefix=row.prefix,
        org_name=row.name,
        allowed_models=decode_models(row.allowed_models),
        revoked=bool(row.revoked),
        created_at=row.created_at,
    )


async def list_keys(db: Database, org_name: str) -> list[ApiKeyInfo]:
    org = await get_org(db, org_name)
    query = _info_query(api_keys.c.org_id == org.id).order_by(api_keys.c.created_at, api_keys.c.id)
    async with db.engine.connect() as conn:
        return [_info(row) for row in (await conn.execute(query)).all()]


async def revoke_key(db: Database, prefix_or_key: str) -> ApiKeyInfo:
    """Revoke by visible prefix (or by the whole key, if that is what the operator has)."""
    value = prefix_or_key.strip()
    if len(value) > len(KEY_SCHEME) + _VISIBLE_LENGTH:
        match = api_keys.c.key_hash == hash_key(value)
    else:
        match = api_keys.c.prefix == value
    async with db.engine.begin() as conn:
        result = await conn.execute(api_keys.update().where(match).values(revoked=True))
        if result.rowcount == 0:
            raise NotFound(f"no API key {value!r}")
        return _info((await conn.execute(_info_query(match))).one())
