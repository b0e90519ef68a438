"""deploy/haproxy/haproxy.cfg: valid for HAProxy itself (`haproxy -c`), in its deployed form and in
the loopback form the cluster tests run, and consistent with the gateways it fronts."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from kiln.gateway.cli import main as gateway_cli
from kiln.gateway.settings import Settings
from tests.cluster import BACKEND, haproxy, loopback_haproxy_config
from tests.conformance import assert_error
from tests.deploy.files import HAPROXY, compose, role
from tests.support import Proc, free_port

needs_haproxy = pytest.mark.skipif(haproxy() is None, reason="haproxy is not installed (./dev setup installs it where apt is available)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _check(path) -> subprocess.CompletedProcess:
    return subprocess.run([haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)


def _warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if "[WARNING]" in line or "[ALERT]" in line]


def _directives(name: str) -> dict[str, str]:
    """`keyword value` lines of one section of the deployed file (later lines win)."""
    values: dict[str, str] = {}
    section = ""
    for line in HAPROXY.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            section = line.strip()
        elif section == name and line.strip() and not line.strip().startswith("#"):
            words = line.split()
            key = " ".join(words[:2]) if words[0] in ("timeout", "option", "http-check") else words[0]
            values[key] = " ".join(words[len(key.split()):])
    return values


def _seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)([a-z]*)", value).groups()
    return int(number) * _UNITS[unit or "ms"]


def _default(flag: str) -> float:
    return next(p.default for p in gateway_cli.params if f"--{flag}" in p.opts)


@needs_haproxy
def test_the_deployed_config_is_valid():
    result = _check(HAPROXY)
    assert result.returncode == 0, result.stdout + result.stderr
    # The compose service names do not resolve here; HAProxy says so and starts anyway
    # (init-addr none), as it must while a gateway container is still being created.
    others = [w for w in _warnings(result.stdout + result.stderr) if "could not resolve address" not in w]
    assert others == []


@needs_haproxy
def test_the_loopback_form_the_cluster_tests_run_is_valid(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text(loopback_haproxy_config(HAPROXY.read_text(), port=18080, stats_port=18404, servers={"gateway-0": "127.0.0.1:18081", "gateway-1": "127.0.0.1:18082"}))
    result = _check(config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _warnings(result.stdout + result.stderr) == []
    text = config.read_text()
    assert "server gateway-0 127.0.0.1:18081" in text and "gateway-1:8080" not in text
    assert "bind 127.0.0.1:18080" in text and "bind :8080" not in text


def test_backend_servers_are_the_compose_gateways():
    """The servers are the compose file's gateway services, on the port each listens on."""
    services = compose()["services"]
    gateways = {name: service["environment"]["KILN_PORT"] for name, service in services.items() if role(service.get("command")) == "gateway"}
    servers = re.findall(r"^\s+server (\S+) (\S+)", HAPROXY.read_text(), re.M)
    assert dict(servers) == {name: f"{name}:{port}" for name, port in gateways.items()}


def test_balancing_and_health_checks():
    backend = _directives(BACKEND)
    assert backend["balance"] == "roundrobin"
    assert "option httpchk" in backend
    assert "uri /health" in backend["http-check send"]
    assert backend["http-check expect"] == "status 200"  # 503 = no worker registered: out of rotation
    assert "check" in backend["default-server"].split()


def test_timeouts_outlast_what_the_gateway_lets_a_request_take():
    defaults = _directives("defaults")
    silent = max(_default("first-event-timeout"), _default("event-timeout"))
    # A proxy timeout shorter than the gateway's own bounds would cut answers the gateway still
    # considers healthy (a non-streaming answer is silent until it is complete).
    assert _seconds(defaults["timeout server"]) > silent
    assert _seconds(defaults["timeout client"]) > silent
    assert _seconds(defaults["timeout tunnel"]) > 2 * Settings.websocket_ping_interval_s
    # Nothing buffers a stream: no request buffering, no compression.
    lines = [line.split("#")[0] for line in HAPROXY.read_text().splitlines()]
    assert not any("http-buffer-request" in line or "compression" in line for line in lines)
    # Only connections that never reached a gateway are retried elsewhere (retry-on's default).
    assert not any("retry-on" in line for line in lines) and "option redispatch" in defaults


@pytest.fixture
def refusing_and_closing():
    """Two stand-in gateways: a port nothing listens on, and one that accepts and hangs up."""
    closing = socket.socket()
    closing.bind(("127.0.0.1", 0))
    closing.listen(16)
    stop = threading.Event()

    def hang_up() -> None:
        closing.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = closing.accept()
            except OSError:
                continue
            conn.recv(65536)
            conn.close()

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    yield free_port(), closing.getsockname()[1]
    stop.set()
    thread.join(5)
    closing.close()


@needs_haproxy
@pytest.mark.parametrize("case", ["no gateway up", "a gateway hangs up"])
def test_haproxys_own_errors_keep_the_apis_shape(tmp_path, refusing_and_closing, case):
    refused, closing = refusing_and_closing
    port = free_port()
    servers = {"gateway-0": f"127.0.0.1:{refused}"} if case == "no gateway up" else {"gateway-0": f"127.0.0.1:{closing}"}
    config = tmp_path / "haproxy.cfg"
    text = loopback_haproxy_config(HAPROXY.read_text(), port=port, stats_port=free_port(), servers=servers)
    # Health checks off, so the request itself meets the stand-in (a check would mark it down first).
    assert "default-server check " in text
    config.write_text(text.replace("default-server check ", "default-server no-check "))
    balancer = Proc([haproxy(), "-db", "-f", str(config)], dict(os.environ), tmp_path / "haproxy.log").start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json={"model": "m", "input": "hi"}, timeout=30)
                break
            except httpx.TransportError:  # HAProxy still starting
                assert time.monotonic() < deadline and balancer.alive(), balancer.log()
                time.sleep(0.1)
    finally:
        balancer.kill(signal.SIGTERM)
    if case == "no gateway up":
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert_error(r.json())
        assert r.json()["error"]["code"] == "server_is_overloaded"
    else:
        assert r.status_code == 502 and r.headers["content-type"].startswith("text/plain")
