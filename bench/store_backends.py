"""What ``--store redis`` adds to a request over ``--store memory``, without a model.

    python -m bench.store_backends [--runs 3] [--quick] [--redis-url URL] [--json out.json]

Both servers are ``kiln serve --engine scripted`` (scripted delay 0, reply "ok"); one keeps its
stores in memory, the other in Redis (a fresh namespace, dropped afterwards). Two workloads, each
from 1 and 16 concurrent clients in a closed loop:

- ``create``: a non-streaming POST /v1/responses with ``store`` on (what every stored create pays:
  the in-flight registration and the stored response);
- ``chain``: a create continuing the client's previous response (``previous_response_id``: one
  read) followed by a GET of it (another read); each client starts a new chain every
  ``CHAIN_TURNS`` steps (a stored response holds its whole history, so what Redis moves per step
  grows with the chain).

p50/p99 latency per request (a chain step counts as one) and requests/s, medians over runs; the
difference is the store backend's cost. Redis should run on the same host or LAN as in production.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

import httpx

from .client import median, percentile
from .servers import Server, spec_for

CHAIN_TURNS = 8


def progress(msg: str) -> None:
    print(f"[store {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def load(base_url: str, model: str, workload: str, concurrency: int, total: int) -> dict:
    latencies: list[float] = []
    failures: list[str] = []
    remaining = total
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60.0) as client:

        async def step(previous: str | None) -> str | None:
            body = {"model": model, "input": "hi", "max_output_tokens": 2}
            if workload == "stateless":  # bench/replicas.py: what needs no store at all
                body["store"] = False
            if workload == "chain" and previous is not None:
                body["previous_response_id"] = previous
            r = await client.post("/v1/responses", json=body)
            if r.status_code != 200:
                failures.append(f"HTTP {r.status_code}: {r.text[:200]}")
                return None
            rid = r.json()["id"]
            if workload == "chain":
                got = await client.get(f"/v1/responses/{rid}")
                if got.status_code != 200:
                    failures.append(f"GET {got.status_code}: {got.text[:200]}")
                    return None
            return rid

        async def one_client() -> None:
            nonlocal remaining
            previous = None
            steps = 0
            while remaining > 0:
                remaining -= 1
                steps += 1
                if steps % CHAIN_TURNS == 0:
                    previous = None
                t0 = time.perf_counter()
                try:
                    previous = await step(previous)
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    previous = None
                    continue
                if previous is not None:
                    latencies.append(time.perf_counter() - t0)

        for _ in range(min(20, total)):  # warm-up
            await step(None)
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ms = [x * 1000 for x in latencies]
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "req_per_s": len(latencies) / wall if wall > 0 else None, "ok": len(latencies), "failed": len(failures),
        "first_failure": failures[0] if failures else None}


def drop_namespace(url: str, namespace: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
    finally:
        client.close()


def load_options(prog: str, doc: str, concurrency: str) -> argparse.ArgumentParser:
    """The options of the closed-loop load benches (this one and bench/replicas.py)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=None, help="default 3; --quick: 1")
    p.add_argument("--quick", action="store_true", help="fewer requests, 1 run")
    p.add_argument("--concurrency", default=concurrency)
    p.add_argument("--redis-url", default=os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--json", type=Path, default=None)
    return p


def load_plan(opts: argparse.Namespace, quick: tuple[int, int], full: tuple[int, int]) -> tuple[int, list[int], dict[int, int], str]:
    """Runs, client counts, requests per client count and a fresh Redis namespace. ``quick`` and
    ``full`` are (requests at one client, requests per client above one)."""
    runs = opts.runs or (1 if opts.quick else 3)
    levels = [int(c) for c in opts.concurrency.split(",")]
    alone, per_client = quick if opts.quick else full
    total = {c: alone if c == 1 else per_client * c for c in levels}
    return runs, levels, total, f"kiln-bench-{uuid.uuid4().hex[:8]}"


def main(argv: list[str] | None = None) -> int:
    p = load_options("python -m bench.store_backends", __doc__, "1,16")
    p.add_argument("--log-dir", type=Path, default=None)
    opts = p.parse_args(argv)
    runs, levels, total, namespace = load_plan(opts, quick=(100, 10), full=(300, 30))
    specs = {
        "memory": spec_for("kiln_scripted", scripted_delay=0.0, scripted_reply="ok", kiln_args=["--store", "memory"]),
        "redis": spec_for("kiln_scripted", scripted_delay=0.0, scripted_reply="ok", kiln_args=["--store", "redis", "--redis-url", opts.redis_url, "--redis-namespace", namespace]),
    }
    workloads = ("create", "chain")
    results: dict[str, dict[str, dict[int, list[dict]]]] = {b: {w: {c: [] for c in levels} for w in workloads} for b in specs}
    try:
        with Server(specs["memory"], log_dir=opts.log_dir) as memory, Server(specs["redis"], log_dir=opts.log_dir) as shared:
            servers = {"memory": memory, "redis": shared}
            for run in range(runs):
                for workload in workloads:
                    for c in levels:
                        for name, server in servers.items():  # interleaved: both see the same machine load
                            r = asyncio.run(load(server.spec.base_url, server.spec.model, workload, c, total[c]))
                            results[name][workload][c].append(r)
                            progress(f"run {run + 1}/{runs} {name} {workload} x{c}: p50 {r['p50_ms'] or 0:.2f} ms, p99 {r['p99_ms'] or 0:.2f} ms, {r['req_per_s'] or 0:.0f} req/s, {r['failed']} failed"
                                + (f" ({r['first_failure']})" if r["failed"] else ""))
    finally:
        drop_namespace(opts.redis_url, namespace)

    print(f"\n--store memory vs --store redis — medians over {runs} run(s)")
    header = f"{'workload':>8}  {'clients':>7}  {'mem p50':>8}  {'redis p50':>9}  {'added':>6}  {'mem p99':>8}  {'redis p99':>9}  {'added':>6}  {'mem req/s':>9}  {'redis req/s':>11}"
    print(header)
    print("-" * len(header))
    summary: dict[str, dict[int, dict]] = {}
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for workload in workloads:
        for c in levels:
            row = {f"{b}_{k}": median([r[k] for r in results[b][workload][c]]) for b in specs for k in ("p50_ms", "p99_ms", "req_per_s")}
            summary.setdefault(workload, {})[c] = row
            add50 = row["redis_p50_ms"] - row["memory_p50_ms"] if None not in (row["redis_p50_ms"], row["memory_p50_ms"]) else None
            add99 = row["redis_p99_ms"] - row["memory_p99_ms"] if None not in (row["redis_p99_ms"], row["memory_p99_ms"]) else None
            print(f"{workload:>8}  {c:>7}  {f(row['memory_p50_ms']):>8}  {f(row['redis_p50_ms']):>9}  {f(add50):>6}  {f(row['memory_p99_ms']):>8}  {f(row['redis_p99_ms']):>9}  {f(add99):>6}  "
                f"{row['memory_req_per_s'] or 0:>9.0f}  {row['redis_req_per_s'] or 0:>11.0f}")
    print("latencies in ms; a chain step is one continuing create plus one GET")
    if opts.json:
        opts.json.write_text(json.dumps({"runs": runs, "totals": total, "raw": results, "median": summary}, indent=2, default=str))
        print(f"\nwrote {opts.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
