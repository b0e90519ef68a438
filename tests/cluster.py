"""A Kiln cluster on loopback, for the scale-out end-to-end tests (docs/deploy.md).

HAProxy, configured from deploy/haproxy/haproxy.cfg itself (only its ``bind`` and ``server`` lines
are replaced, so the tests run the production timeouts, health checks and retries), round-robins
over N ``kiln-gateway`` processes; M ``kiln-worker`` processes each connect to the gateways they
are given. Every port is a free loopback one. All processes share one worker secret (CURVE, as in
production) and one ``--secret-key`` (so sealed content from one replica opens on another).

    cluster = Cluster(tmp, gateways=2, workers=[[0], [1]]).start()   # a worker per gateway
    cluster = Cluster(tmp, gateways=2, workers=[[0, 1], [0, 1]])     # every worker on both
    cluster = Cluster(tmp, store="redis", redis_url=URL)             # shared state (h-redis)
    cluster = Cluster(tmp, workers=[[0, 1]], with_haproxy=False)     # replicas without a balancer
    cluster = Cluster(tmp, redis_url=URL, discover=True)             # workers find the replicas in Redis

A worker given several gateways gets one ``--gateway`` per address (with ``discover``, none: the
gateways advertise their worker sockets in Redis and the workers get ``--discover-redis``); a
worker's argv starts with ``worker_prefix`` (``ip netns exec NAME`` puts it on "another host"),
and the gateways bind their worker sockets on ``workers_host``. A gateway given ``store`` gets
``--store STORE``, and with ``redis_url`` also ``--redis-url`` and a ``--redis-namespace`` unique
to this cluster (unless one is given); ``database_url`` is passed as ``--database-url``.
"""

from __future__ import annotations

import csv
import io
import os
import re
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support import REPO, Proc, free_port, process_env

HAPROXY_CONFIG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
# The sections of deploy/haproxy/haproxy.cfg whose lines the loopback copy replaces.
API_FRONTEND, STATS_FRONTEND, BACKEND = "frontend kiln", "frontend stats", "backend kiln_gateways"
_ROUTED = re.compile(r'^kiln_worker_requests_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)


def haproxy() -> str | None:
    """The haproxy binary, or None (./dev setup installs it where it can)."""
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None)


def loopback_haproxy_config(source: str, *, port: int, stats_port: int, servers: dict[str, str]) -> str:
    """deploy/haproxy/haproxy.cfg with its API and stats frontends bound to loopback ports and its
    backend's servers replaced by `servers` (name -> host:port) and a loopback-sized global maxconn.
    Everything else is kept."""
    out: list[str] = []
    section = ""
    seen: set[str] = set()
    for line in source.splitlines():
        stripped = line.strip()
        if line and not line[0].isspace() and not line.startswith("#"):
            if section == BACKEND:
                out += [f"    server {name} {address}" for name, address in servers.items()]
            section = stripped
            seen.add(section)
        elif section in (API_FRONTEND, STATS_FRONTEND) and stripped.startswith("bind "):
            out.append(f"    bind 127.0.0.1:{port if section == API_FRONTEND else stats_port}")
            continue
        elif section == BACKEND and stripped.startswith(("server ", "server-template ")):
            continue
        elif section == "global" and stripped.startswith("maxconn "):
            # HAProxy asks for ~2 file descriptors per connection at start. A test process that
            # imported mlx_lm has a soft limit of 2048 (mlx_lm.utils sets RLIMIT_NOFILE to
            # (2048, 4096) at import), which HAProxy inherits and cannot raise for 8192.
            out.append("    maxconn 512")
            continue
        out.append(line)
    if section == BACKEND:
        out += [f"    server {name} {address}" for name, address in servers.items()]
    missing = {API_FRONTEND, STATS_FRONTEND, BACKEND} - seen
    if missing:
        raise ValueError(f"{HAPROXY_CONFIG} has no {', '.join(sorted(missing))} section")
    return "\n".join(out) + "\n"


@dataclass
class Cluster:
    """HAProxy, gateways and workers as separate processes, so a test can kill any one of them."""

    tmp: Path
    gateways: int = 2
    # For each worker, the indices of the gateways it connects to. Default: one worker per gateway.
    workers: list[list[int]] | None = None
    gateway_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    store: str | None = None
    redis_url: str | None = None
    redis_namespace: str | None = None
    database_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    heartbeat_timeout: float = 3.0
    with_haproxy: bool = True  # False: the gateways alone, each reached on its own port
    workers_host: str = "127.0.0.1"  # where the gateways bind their worker sockets
    worker_prefix: list[str] = field(default_factory=list)  # what runs each worker
    discover: bool = False  # workers find the gateways through Redis (needs redis_url)
    admin_token: str | None = None  # hosted mode: what /metrics needs (sent as a Bearer token)

    def __post_init__(self) -> None:
        if self.workers is None:
            self.workers = [[i] for i in range(self.gateways)]
        if self.redis_url and self.redis_namespace is None:
            self.redis_namespace = f"kiln-test-{secrets.token_hex(4)}"
        self.ports = [free_port() for _ in range(self.gateways)]
        self.worker_addresses = [f"tcp://{self.workers_host}:{free_port()}" for _ in range(self.gateways)]
        self.port, self.stats_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.names = [f"gateway-{i}" for i in range(self.gateways)]
        self._secrets = {"KILN_WORKER_SECRET": secrets.token_urlsafe(24), "KILN_SECRET_KEY": secrets.token_urlsafe(24)}
        self.gateway_procs: list[Proc | None] = [None] * self.gateways
        self.worker_procs: list[Proc] = []
        self.balancer: Proc | None = None

    # ---- processes ---------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        return process_env({**self._secrets, **self.env})

    def gateway_argv(self, i: int) -> list[str]:
        argv = [sys.executable, "-m", "kiln.gateway", "--port", str(self.ports[i]), "--workers-bind", self.worker_addresses[i], "--heartbeat-timeout", str(self.heartbeat_timeout)]
        if self.store:
            argv += ["--store", self.store]
        if self.redis_url:
            argv += ["--redis-url", self.redis_url, "--redis-namespace", str(self.redis_namespace)]
        if self.discover:
            argv += ["--advertise-workers", self.worker_addresses[i]]
        if self.database_url:
            argv += ["--database-url", self.database_url]
        return argv + self.gateway_args

    def start_gateway(self, i: int) -> Proc:
        """Start (or start again, on the same ports) gateway `i`."""
        proc = Proc(self.gateway_argv(i), self._env(), self.tmp / f"{self.names[i]}.log").start()
        self.gateway_procs[i] = proc
        return proc

    def add_worker(self, gateways: list[int], extra: list[str] | None = None) -> Proc:
        argv = [*self.worker_prefix, sys.executable, "-m", "kiln.worker"]
        for i in gateways:
            argv += ["--gateway", self.worker_addresses[i]]
        if self.discover:
            argv += ["--discover-redis", str(self.redis_url), "--redis-namespace", str(self.redis_namespace)]
        proc = Proc([*argv, *self.worker_args, *(extra or [])], self._env(), self.tmp / f"worker-{len(self.worker_procs)}.log").start()
        self.worker_procs.append(proc)
        return proc

    def start(self, timeout: float = 240) -> Cluster:
        binary = haproxy()
        if binary is None and self.with_haproxy:
            raise RuntimeError("haproxy is not installed (./dev setup installs it where apt is available)")
        try:
            for i in range(self.gateways):
                self.start_gateway(i)
            for gateways in self.workers or []:
                self.add_worker(gateways)
            if self.with_haproxy:
                config = self.tmp / "haproxy.cfg"
                servers = {name: f"127.0.0.1:{port}" for name, port in zip(self.names, self.ports, strict=False)}
                config.write_text(loopback_haproxy_config(HAPROXY_CONFIG.read_text(), port=self.port, stats_port=self.stats_port, servers=servers))
                self.balancer = Proc([binary, "-db", "-f", str(config)], self._env(), self.tmp / "haproxy.log").start()
            self.wait_ready(timeout)
        except BaseException:
            self.stop()  # a fixture that fails here never reaches its own cleanup
            raise
        return self

    def stop(self) -> None:
        for proc in [*self.worker_procs, *self.gateway_procs, self.balancer]:
            if proc is not None:
                proc.kill(signal.SIGTERM)

    def kill_gateway(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.gateway_procs[i]
        if proc is not None:
            proc.kill(sig)

    # ---- what the cluster says about itself ------------------------------------------------------

    def gateway_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def expected_workers(self, i: int) -> int:
        return sum(1 for gateways in self.workers or [] if i in gateways or self.discover)

    def registered(self, i: int) -> int:
        """Workers registered with gateway `i` (its /health), -1 when it does not answer."""
        try:
            return len(httpx.get(self.gateway_url(i) + "/health", timeout=2).json()["workers"])
        except (httpx.HTTPError, ValueError, KeyError):
            return -1

    def balancer_status(self) -> dict[str, str]:
        """HAProxy's view of each gateway ("UP", "DOWN", "UP 1/2", ...), from its stats CSV."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=2).text.lstrip("# ")
        backend = BACKEND.split()[1]
        return {row["svname"]: row["status"] for row in csv.DictReader(io.StringIO(text)) if row["pxname"] == backend and row["svname"] in self.names}

    def routed(self, i: int) -> float:
        """Requests gateway `i` has sent to workers (its /metrics), over all its workers."""
        return sum(self.routed_by_worker(i).values())

    def routed_by_worker(self, i: int) -> dict[str, float]:
        """Requests gateway `i` has sent to each worker (its /metrics), by worker tag."""
        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else None
        text = httpx.get(self.gateway_url(i) + "/metrics", headers=headers, timeout=5).text
        counts: dict[str, float] = {}
        for m in _ROUTED.finditer(text):
            worker = re.search(r'worker="([^"]+)"', m["labels"])
            key = worker[1] if worker else ""
            counts[key] = counts.get(key, 0.0) + float(m["value"])
        return counts

    def wait_until(self, what: str, check, timeout: float) -> None:
        """Poll `check()` until it is true; fail with the processes' logs after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.balancer is not None and not self.balancer.alive():
                raise RuntimeError(f"haproxy exited:\n{self.balancer.log()}")
            try:
                if check():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        procs = [p for p in [self.balancer, *self.gateway_procs, *self.worker_procs] if p is not None]
        logs = "\n".join(f"--- {p.log_path.name}\n{p.log()}" for p in procs)
        raise RuntimeError(f"cluster: {what} not within {timeout}s:\n{logs}")

    def wait_ready(self, timeout: float) -> None:
        """Every gateway has its workers, and HAProxy sees every gateway up."""
        for i in range(self.gateways):
            self.wait_until(f"{self.names[i]} has {self.expected_workers(i)} workers", lambda i=i: self.registered(i) >= self.expected_workers(i), timeout)
        if self.with_haproxy:
            self.wait_until("haproxy sees every gateway up", lambda: set(self.balancer_status().values()) == {"UP"}, timeout)

    def aim(self, replica: str) -> None:
        """Make HAProxy's next request land on `replica` (a name in ``names``). Round robin
        alternates per request, so probe ``/health`` (cheap, no generation) until a probe lands on
        another replica. Only meaningful while the test is the balancer's only client."""
        seen: list[str | None] = []
        while len(seen) < 4 * self.gateways:
            seen.append(httpx.get(self.base_url + "/health", timeout=10).headers.get("x-kiln-replica"))
            if seen[-1] != replica:
                return
        raise AssertionError(f"round robin never turned from {replica}: {seen}; HAProxy says {self.balancer_status()}\n{self.balancer.log() if self.balancer else ''}")

    def on(self, replica: str, method, *args, **kwargs):
        """Call an OpenAI SDK ``with_raw_response`` method with its request landing on `replica`;
        its parsed value, checked to have been answered by `replica` (``X-Kiln-Replica``)."""
        self.aim(replica)
        raw = method(*args, **kwargs)
        assert raw.headers["x-kiln-replica"] == replica, (raw.headers.get("x-kiln-replica"), replica)
        return raw.parse()

    def health(self, i: int) -> dict:
        return httpx.get(self.gateway_url(i) + "/health", timeout=5).json()

    def worker_ids(self, i: int) -> list[str]:
        """The ids of the workers registered with gateway `i`, sorted."""
        return sorted(w["tag"] for w in self.health(i)["workers"])
