"""The gateway replicas advertised in Redis (``--discover-redis``), read on a thread of its own.

Every ``DISCOVERY_POLL_S`` the thread reads the live advertisements (kiln.protocol.discovery) and
publishes them as one frozenset; the server's I/O loop compares it with its links at its own pace,
so Redis never blocks heartbeats. While Redis cannot be read the last answer stands: a gateway is
never dropped for Redis being down, only for being gone from a set that could be read (and then
only once it has stopped answering, see server.py).
"""

from __future__ import annotations

import logging
import threading

from kiln.protocol.discovery import DISCOVERY_POLL_S, LIVE, gateways_key, live_addresses

log = logging.getLogger("kiln.worker.discovery")


class RedisDiscovery:
    def __init__(self, url: str, namespace: str, *, poll_s: float = DISCOVERY_POLL_S) -> None:
        from redis import Redis

        self._redis = Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._script = self._redis.register_script(LIVE)
        self._key = gateways_key(namespace)
        self._poll_s = poll_s
        self._addresses: frozenset[str] | None = None  # None until Redis has answered once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kiln-discovery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if not self._thread.is_alive():
            self._redis.close()  # else the thread closes it on its way out

    def addresses(self) -> frozenset[str] | None:
        """The advertised worker addresses as last read; None before the first answer."""
        return self._addresses

    def read(self) -> frozenset[str]:
        return live_addresses(list(self._script(keys=[self._key])))

    def _loop(self) -> None:
        from redis.exceptions import RedisError

        failing = False
        while not self._stop.is_set():
            try:
                found = self.read()
                if found != self._addresses:
                    log.info("gateways advertised in Redis", extra={"gateways": sorted(found)})
                self._addresses = found
                failing = False
            except (RedisError, OSError) as exc:
                if not failing:  # once per outage
                    log.warning("cannot read the advertised gateways from Redis (keeping the last ones): %s", type(exc).__name__)
                failing = True
            self._stop.wait(self._poll_s)
        self._redis.close()
