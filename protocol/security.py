"""Worker authentication: ZeroMQ CURVE keys derived from one shared secret.

Anyone who can reach the gateway's worker socket could otherwise register as a worker, read other
tenants' prompts and report whatever usage it likes. With a secret set on both daemons, the
gateway's ROUTER is a CURVE server and admits only clients holding the workers' key; both keypairs
are derived from the secret, so operators distribute one string instead of four keys, and every
frame between gateway and worker is encrypted.

Without a secret both sides use plain ZeroMQ, which is only safe on loopback or ``ipc://``;
``is_local_endpoint`` tells the gateway when it must refuse to start without one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

# Shorter secrets are guessable offline; `kiln serve` generates 43 characters.
MIN_SECRET_CHARS = 16
# The ZAP domain the gateway's worker socket announces; its ZAP handler answers only this one.
ZAP_DOMAIN = b"kiln-workers"


class SecretError(ValueError):
    """The worker secret is missing where required, unreadable, or too short."""


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE keypairs of the gateway (server) and of every worker (client)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _keypair(secret: str, role: bytes) -> tuple[bytes, bytes]:
    # A keyed hash per role: the two keypairs are independent, and neither reveals the secret.
    raw = hmac.new(secret.encode(), b"kiln worker curve v1 " + role, hashlib.sha256).digest()
    secret_key = z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def derive_keys(secret: str) -> CurveKeys:
    """The same secret always gives the same keys, on every host."""
    server_public, server_secret = _keypair(secret, b"gateway")
    client_public, client_secret = _keypair(secret, b"worker")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def load_secret(value: str | None, path: str | None) -> str | None:
    """The secret from ``--worker-secret`` or the file named by ``--worker-secret-file``.

    A file keeps the secret out of ``ps`` and shell history; surrounding whitespace (the trailing
    newline of ``echo ... > file``) is not part of it.
    """
    if value and path:
        raise SecretError("set either --worker-secret or --worker-secret-file, not both")
    if path:
        try:
            value = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SecretError(f"cannot read the worker secret file {path!r} ({type(exc).__name__})") from None
        if not value:
            raise SecretError(f"the worker secret file {path!r} is empty")
    if not value:
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise SecretError(f"the worker secret must be at least {MIN_SECRET_CHARS} characters")
    return value


def generate_secret() -> str:
    """A fresh random secret (what `kiln serve` hands its own gateway and workers)."""
    import secrets

    return secrets.token_urlsafe(32)


def secure_gateway_socket(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make the gateway's ROUTER a CURVE server that asks the ZAP handler about each client.

    Call before ``bind``; the caller runs the ZAP handler (gateway/pool/worker_auth.py).
    """
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.zap_domain = ZAP_DOMAIN


def secure_worker_socket(sock: zmq.Socket[Any], secret: str | None) -> None:
    """Make a worker's DEALER a CURVE client of the gateway; a no-op without a secret.

    Call before ``connect``. With the wrong secret the handshake fails, so not a single frame the
    worker sends (its Register included) reaches the gateway.
    """
    if not secret:
        return
    keys = derive_keys(secret)
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def is_local_endpoint(endpoint: str) -> bool:
    """True for addresses only this host can reach: ``ipc://``, ``inproc://``, loopback ``tcp://``.

    Anything else (``0.0.0.0``, ``*``, a public or private address, a host or interface name) may
    be reachable from other machines, so the gateway needs a worker secret to bind it.
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    return is_loopback_host(rest.rsplit(":", 1)[0] if ":" in rest else rest)


def is_loopback_host(host: str) -> bool:
    """True for localhost and loopback IP literals (127.0.0.0/8, ::1), brackets allowed; 0.0.0.0,
    :: and every other address or name may be reachable from other machines."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
