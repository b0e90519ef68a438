"""What a second gateway replica buys, and what ``--store redis`` costs, behind HAProxy.

    python -m bench.replicas [--runs 3] [--quick] [--redis-url URL] [--json out.json]

Three clusters on loopback, each HAProxy (deploy/haproxy/haproxy.cfg, via tests/cluster.py) in
front of gateways whose two workers run the scripted engine (scripted delay 0, reply "ok": no
model, so what is measured is the gateways' own ceiling):

- ``1 x memory``: one gateway, ``--store memory``;
- ``2 x memory``: two gateways, ``--store memory`` (only stateless requests make sense here);
- ``1 x redis`` and ``2 x redis``: one and two gateways on one Redis, ``--store redis``.

Workloads (bench/store_backends.py's closed loop, 1 and 32 clients): ``stateless`` (``store``
false), ``create`` (a stored response) and ``chain`` (a create continuing the previous response
through ``previous_response_id``, then a GET of it; on two replicas the steps alternate replicas).
p50/p99 latency and requests/s, medians over runs; the clusters are measured interleaved, so all
see the same machine load. The gateways share the machine's cores with HAProxy, the workers and
the client: on a small machine a second replica adds processes, not cores.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from tests.cluster import Cluster

from .client import median
from .store_backends import drop_namespace, load, load_options, load_plan

MODEL = "kiln-scripted"
WORKER_ARGS = ["--engine", "scripted", "--scripted-delay", "0", "--scripted-reply", "ok", "--max-batch", "64", "--queue-depth", "512"]
# Which workloads each cluster runs: chains and stored reads across replicas need the shared store.
TOPOLOGIES = {
    "1 x memory": (1, "memory", ("stateless", "create", "chain")),
    "2 x memory": (2, "memory", ("stateless",)),
    "1 x redis": (1, "redis", ("stateless", "create", "chain")),
    "2 x redis": (2, "redis", ("stateless", "create", "chain")),
}
WORKLOADS = ("stateless", "create", "chain")


def progress(msg: str) -> None:
    print(f"[replicas {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cluster_for(tmp: Path, replicas: int, store: str, redis_url: str, namespace: str) -> Cluster:
    return Cluster(
        tmp, gateways=replicas, workers=[list(range(replicas)), list(range(replicas))], store=store,
        redis_url=redis_url if store == "redis" else None, redis_namespace=namespace if store == "redis" else None,
        worker_args=WORKER_ARGS,
    )


def main(argv: list[str] | None = None) -> int:
    opts = load_options("python -m bench.replicas", __doc__, "1,32").parse_args(argv)
    runs, levels, total, namespace = load_plan(opts, quick=(60, 6), full=(200, 20))
    results: dict[str, dict[str, dict[int, list[dict]]]] = {t: {w: {c: [] for c in levels} for w in spec[2]} for t, spec in TOPOLOGIES.items()}
    clusters: dict[str, Cluster] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-replicas-") as tmp:
        try:
            for name, (replicas, store, _) in TOPOLOGIES.items():
                directory = Path(tmp) / name.replace(" ", "")
                directory.mkdir()
                progress(f"starting {name}")
                clusters[name] = cluster_for(directory, replicas, store, opts.redis_url, f"{namespace}-{replicas}").start(timeout=180)
            for run in range(runs):
                for workload in WORKLOADS:
                    for c in levels:
                        for name, cluster in clusters.items():  # interleaved
                            if workload not in TOPOLOGIES[name][2]:
                                continue
                            r = asyncio.run(load(cluster.base_url, MODEL, workload, c, total[c]))
                            results[name][workload][c].append(r)
                            progress(f"run {run + 1}/{runs} {name} {workload} x{c}: p50 {r['p50_ms'] or 0:.2f} ms, p99 {r['p99_ms'] or 0:.2f} ms, {r['req_per_s'] or 0:.0f} req/s, {r['failed']} failed"
                                + (f" ({r['first_failure']})" if r["failed"] else ""))
        finally:
            for cluster in clusters.values():
                cluster.stop()
            for replicas in (1, 2):
                try:
                    drop_namespace(opts.redis_url, f"{namespace}-{replicas}")
                except Exception as exc:  # Redis unreachable: nothing to drop
                    progress(f"could not drop the Redis namespace: {exc}")

    print(f"\nHAProxy in front of 1 or 2 gateways (scripted engine) — medians over {runs} run(s); vs = the same row of 1 x memory")
    header = f"{'workload':>9}  {'clients':>7}  {'cluster':>10}  {'p50 ms':>7}  {'vs':>7}  {'p99 ms':>7}  {'vs':>7}  {'req/s':>6}  {'vs':>6}"
    print(header)
    print("-" * len(header))
    summary: dict[str, dict[str, dict[int, dict]]] = {}
    for workload in WORKLOADS:
        for c in levels:
            base = None
            for name in TOPOLOGIES:
                if workload not in results[name]:
                    continue
                row = {k: median([r[k] for r in results[name][workload][c] if r[k] is not None] or [None]) for k in ("p50_ms", "p99_ms", "req_per_s")}
                row["failed"] = sum(r["failed"] for r in results[name][workload][c])
                summary.setdefault(name, {}).setdefault(workload, {})[c] = row
                base = base or row
                d = lambda k, row=row, base=base: "-" if None in (row[k], base[k]) else f"{row[k] - base[k]:+.2f}"  # noqa: E731
                ratio = "-" if not (row["req_per_s"] and base["req_per_s"]) else f"x{row['req_per_s'] / base['req_per_s']:.2f}"
                v = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
                print(f"{workload:>9}  {c:>7}  {name:>10}  {v(row['p50_ms']):>7}  {d('p50_ms'):>7}  {v(row['p99_ms']):>7}  {d('p99_ms'):>7}  {row['req_per_s'] or 0:>6.0f}  {ratio:>6}"
                    + (f"  ({row['failed']} failed)" if row["failed"] else ""))
    print("a chain step is one continuing create plus one GET")
    if opts.json:
        opts.json.write_text(json.dumps({"runs": runs, "totals": total, "raw": results, "median": summary}, indent=2, default=str))
        print(f"\nwrote {opts.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
