"""Sealing content that clients carry between requests (reasoning, compaction summaries).

Codex runs with ``store: false`` and carries reasoning (and compaction summaries) across turns in
``encrypted_content``. Whatever comes back that way is rendered into the model's prompt, so it
must be what this server produced: each blob is signed with HMAC-SHA256 under a server key and
checked on the way back in. The payload itself is readable base64url JSON — the point is
integrity, not secrecy. Gateways that share traffic must share the key (``--secret-key`` /
``KILN_SECRET_KEY``); without one, a random key per process is used and blobs do not survive a
restart.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from typing import Any

PREFIX = "kiln1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SealError(ValueError):
    """A blob that this server did not produce, or that was altered."""


class Sealer:
    def __init__(self, key: str | bytes | None = None) -> None:
        if key is None:
            key = secrets.token_bytes(32)
        self._key = key.encode() if isinstance(key, str) else key

    def _mac(self, kind: str, body: bytes) -> bytes:
        return hmac.new(self._key, f"{PREFIX}.{kind}.".encode() + body, hashlib.sha256).digest()

    def seal(self, kind: str, payload: Any) -> str:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        return f"{PREFIX}.{_b64(body)}.{_b64(self._mac(kind, body))}"

    @staticmethod
    def is_ours(blob: Any) -> bool:
        return isinstance(blob, str) and blob.startswith(PREFIX + ".")

    def unseal(self, kind: str, blob: Any) -> Any:
        if not self.is_ours(blob):
            raise SealError("not produced by this server")
        try:
            _, body_text, mac_text = blob.split(".")
            body, mac = _unb64(body_text), _unb64(mac_text)
        except ValueError as exc:
            raise SealError("malformed") from exc
        if not hmac.compare_digest(mac, self._mac(kind, body)):
            raise SealError("signature mismatch")
        return json.loads(body)
