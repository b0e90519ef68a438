"""Gateway replicas found through Redis: what a gateway advertises and a worker reads.

A gateway started with ``--advertise-workers ADDRESS --redis-url URL`` keeps ``ADDRESS`` (the
ZeroMQ address workers should connect to, its ``--workers-bind`` as others reach it) in one sorted
set per deployment, scored by when its lease ends, and renews the lease every third of it. A worker
started with ``--discover-redis URL`` reads the live members every few seconds and connects to each,
so a replica that appears is served without restarting workers, and one that stops renewing (it
stopped, or crashed) drops out within a lease. Times are the Redis server's (``TIME``), so replica
and worker clocks may disagree.

Both sides run these scripts (the gateway through redis.asyncio, the worker through the blocking
client on its own thread); nothing here talks to Redis itself.
"""

from __future__ import annotations

# How long an advertisement lives without renewal, and how often a worker looks.
ADVERTISE_LEASE_S = 10.0
DISCOVERY_POLL_S = 2.0
# The key prefix both daemons default to (``--redis-namespace``); replicas of one deployment and
# their workers must share it.
DEFAULT_REDIS_NAMESPACE = "kiln"

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1] the set; ARGV: address, lease ms. Adds or renews one advertisement.
ADVERTISE = _NOW_MS + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""

# KEYS[1] the set. Drops lapsed advertisements and returns the live addresses.
LIVE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""

# Advertised addresses a worker accepts: ZeroMQ endpoints of a sane length, a bounded number.
MAX_ADDRESS_LENGTH = 512
MAX_GATEWAYS = 256


def gateways_key(namespace: str) -> str:
    return f"{namespace}:gateways"


def live_addresses(members: list[bytes | str]) -> frozenset[str]:
    """The advertised members a worker will connect to (anything odd is left out)."""
    out = set()
    for member in members[:MAX_GATEWAYS]:
        address = member.decode("utf-8", "replace") if isinstance(member, bytes) else str(member)
        if len(address) <= MAX_ADDRESS_LENGTH and address.startswith(("tcp://", "ipc://")):
            out.add(address)
    return frozenset(out)
