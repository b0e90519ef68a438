"""The container's health check: does the gateway answer ``GET /health``?

Default (the image's HEALTHCHECK, Kubernetes' liveness probe): any HTTP answer is healthy. The
gateway answers 503 while no worker is registered, which says "do not route here" (readiness,
judged by the load balancer on the status), not "restart me": restarting gateways because their
workers are away would only add a second outage. ``--ready`` wants 200.

In a worker's container (no HTTP port; its health is its registration, which the gateways'
``/health`` lists) the check passes while the worker runs. Standard library only: the image has
no curl.
"""

from __future__ import annotations

import http.client
import os
import sys
from pathlib import Path


def runs_worker(proc: Path = Path("/proc")) -> bool:
    """Whether this container runs kiln-worker (PID 1, or a child of an init such as tini)."""
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            if b"kiln-worker" in cmdline.read_bytes():
                return True
        except OSError:  # a process that ended while we looked
            continue
    return False


def main(argv: list[str]) -> int:
    if runs_worker():
        return 0
    port = int(os.environ.get("KILN_PORT", "8080"))
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
    try:
        connection.request("GET", "/health", headers={"Host": "127.0.0.1"})
        status = connection.getresponse().status
    except OSError as exc:
        print(f"no answer on port {port}: {exc}", file=sys.stderr)
        return 1
    finally:
        connection.close()
    if "--ready" in argv:
        return 0 if status == 200 else 1
    return 0 if status in (200, 503) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
