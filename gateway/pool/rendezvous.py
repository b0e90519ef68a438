"""Which worker a routing key belongs to: rendezvous (highest random weight) hashing.

A conversation's prefix cache lives on the worker that served its last turn, so its next turn
should go back there. With several gateway replicas behind a load balancer, the turns of one
conversation land on different replicas, so the choice must not depend on what one replica
remembers: every replica ranks a key's candidate workers by the same hash of (key, worker id) and
so picks the same home, with no state to share or keep. When a worker joins or leaves, only the
keys whose home it is (or becomes) move; the others keep their worker.

The hash is BLAKE2b, not ``hash()``: Python salts ``hash()`` per process, and the ranking must be
the same in every gateway process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def weight(key: str, worker_id: str) -> int:
    """The rendezvous weight of ``worker_id`` for ``key``; the highest weight wins."""
    digest = hashlib.blake2b(f"{key}\x00{worker_id}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: str, candidates: Iterable[T], worker_id: Callable[[T], str]) -> list[T]:
    """``candidates`` in the order ``key`` prefers them: its home first, then where it spills to
    when the home is full (the same order on every gateway, so a spilled conversation also stays
    on one worker)."""
    return sorted(candidates, key=lambda c: (weight(key, worker_id(c)), worker_id(c)), reverse=True)
