"""Sealing reasoning that clients carry between requests in ``encrypted_content``.

Codex runs with ``store: false`` and carries reasoning across turns in ``encrypted_content``.
Whatever comes back that way is rendered into the model's prompt as what the model itself
thought, so it must be what this server produced. Two formats, both checked on the way back in:

- ``kiln1`` (default): readable base64url JSON signed with HMAC-SHA256 — integrity, not secrecy
  (the response shows the same reasoning anyway).
- ``kiln2`` (``--encrypt-reasoning``): AES-256-GCM (``cryptography``'s AESGCM, an authenticated
  cipher: a changed byte fails to decrypt), for operators who do not want clients to read the
  reasoning from the blob. Its key is derived from the server key with HKDF, apart from the MAC key.

Either format is accepted whichever is produced, so switching the setting breaks no session.
Gateways that share traffic must share the key (``--secret-key`` / ``KILN_SECRET_KEY``); ``kiln
serve`` keeps one in its data directory (kiln/state.py) so blobs survive its restarts; without
either, a random key per process is used and blobs do not survive a restart.

Compaction items are not sealed: the spec treats their content as client data (compaction.py).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PREFIX = "kiln1"  # signed
ENCRYPTED = "kiln2"  # encrypted
_NONCE_BYTES = 12


def b64url(data: bytes) -> str:
    """Unpadded base64url, as sealed and compaction contents are written."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SealError(ValueError):
    """A blob that this server did not produce, or that was altered."""


class Sealer:
    def __init__(self, key: str | bytes | None = None, *, encrypt: bool = False) -> None:
        if key is None:
            key = secrets.token_bytes(32)
        self._key = key.encode() if isinstance(key, str) else key
        self.encrypt = encrypt
        cipher_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"kiln reasoning encryption").derive(self._key)
        self._cipher = AESGCM(cipher_key)

    def _mac(self, kind: str, body: bytes) -> bytes:
        return hmac.new(self._key, f"{PREFIX}.{kind}.".encode() + body, hashlib.sha256).digest()

    def seal(self, kind: str, payload: Any) -> str:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        if self.encrypt:
            nonce = os.urandom(_NONCE_BYTES)  # random 96-bit nonces: safe far beyond 2**32 seals per key
            return f"{ENCRYPTED}.{b64url(nonce)}.{b64url(self._cipher.encrypt(nonce, body, f'{ENCRYPTED}.{kind}'.encode()))}"
        return f"{PREFIX}.{b64url(body)}.{b64url(self._mac(kind, body))}"

    @staticmethod
    def is_ours(blob: Any) -> bool:
        return isinstance(blob, str) and blob.startswith((PREFIX + ".", ENCRYPTED + "."))

    def unseal(self, kind: str, blob: Any) -> Any:
        if not self.is_ours(blob):
            raise SealError("not produced by this server")
        try:
            prefix, first, second = blob.split(".")
            first_bytes, second_bytes = _unb64(first), _unb64(second)
        except ValueError as exc:
            raise SealError("malformed") from exc
        if prefix == ENCRYPTED:
            try:
                body = self._cipher.decrypt(first_bytes, second_bytes, f"{ENCRYPTED}.{kind}".encode())
            except (InvalidTag, ValueError):
                raise SealError("it does not decrypt under this server's key") from None
        else:
            body = first_bytes
            if not hmac.compare_digest(second_bytes, self._mac(kind, body)):
                raise SealError("signature mismatch")
        try:
            return json.loads(body)
        except ValueError as exc:  # only a server holding the key could have sealed it
            raise SealError("malformed") from exc
