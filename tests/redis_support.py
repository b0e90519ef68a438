"""Redis for tests: the shared one (CI's, ``KILN_TEST_REDIS_URL``) with a namespace of its own per
test, cleaned up after; or a ``redis-server`` of the test's own on a free port, for tests that
stop, kill and restart it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.support import free_port

REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def shared_redis_url() -> str:
    """CI's Redis; the test is skipped when there is none."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis unavailable at {REDIS_URL}: {exc}")
    finally:
        client.close()
    return REDIS_URL


def new_namespace() -> str:
    return f"kiln-test-{uuid.uuid4().hex[:12]}"


def drop_namespace(url: str, namespace: str) -> int:
    """Delete every key of ``namespace``; how many there were."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
        return len(keys)
    finally:
        client.close()


class RedisServer:
    """A redis-server of the test's own, persisting every write (AOF, fsync always) so that a
    kill and a restart lose nothing Redis acknowledged."""

    def __init__(self, tmp: Path) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.dir = tmp / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir), "--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 20.0) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)
            try:
                if client.ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
            finally:
                client.close()
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def pause(self) -> None:
        """Stalled, not gone: connections open, nothing answers (a hung or partitioned Redis)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
