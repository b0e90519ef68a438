"""What Kiln's gateway and worker protocol add to a request, without a model.

    python -m bench.gateway_overhead [--runs 3] [--quick] [--json out.json]

1. Request latency. The same non-streaming POST /v1/responses goes to
   - kiln: `kiln serve --engine scripted` (scripted delay 0, reply "ok", max_output_tokens 2):
     HTTP -> gateway (validation, store, routing) -> ZeroMQ -> worker -> events -> gateway -> JSON;
   - bare: a Starlette app on Hypercorn (the gateway's own stack) that parses the body and returns
     a canned response of the same shape: the floor the HTTP stack and this client set.
   p50/p99 latency and requests/s at 1 and 64 concurrent clients; medians over runs; the
   difference kiln - bare is the gateway + protocol overhead.
2. Inter-event gaps. One streamed request through `kiln serve --engine scripted` with
   0.02 s per token: the gaps between text deltas should sit near 20 ms (events forwarded as
   they are made), not near 0 with long pauses (events batched somewhere on the way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from .client import ResponsesAPI, median, percentile
from .servers import Server, ServerSpec, free_port, spec_for

CANNED = {
    "id": "resp_bare", "object": "response", "created_at": 0, "status": "incomplete",
    "error": None, "incomplete_details": {"reason": "max_output_tokens"}, "model": "kiln-scripted",
    "output": [{"id": "msg_bare", "type": "message", "role": "assistant", "status": "incomplete",
                "content": [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}]}],
    "usage": {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2,
              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14},
}  # fmt: skip


def bare_app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def responses(request):
        body = await request.json()
        return JSONResponse({**CANNED, "model": body.get("model", "bare"), "created_at": int(time.time())})

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"]), Route("/health", health)])


def serve_bare(port: int) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = "-"
    config.loglevel = "WARNING"
    asyncio.run(serve(bare_app(), config))


def progress(msg: str) -> None:
    print(f"[overhead {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def load(base_url: str, model: str, concurrency: int, total: int) -> dict:
    """`total` requests from `concurrency` clients in a closed loop: latency percentiles, req/s."""
    body = {"model": model, "input": "hi", "max_output_tokens": 2, "stream": False}
    latencies: list[float] = []
    failures: list[str] = []
    remaining = total
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60.0) as client:

        async def one_client() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/responses", json=body)
                    ok = r.status_code == 200 and r.json().get("output")
                    if not ok:
                        failures.append(f"HTTP {r.status_code}: {r.text[:200]}")
                        continue
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                latencies.append(time.perf_counter() - t0)

        # warm-up: connections open, code paths hot
        for _ in range(min(20, total)):
            await client.post("/v1/responses", json=body)
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ms = [x * 1000 for x in latencies]
    return {
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "req_per_s": len(latencies) / wall if wall > 0 else None,
        "ok": len(latencies),
        "failed": len(failures),
        "first_failure": failures[0] if failures else None,
    }


async def gaps(base_url: str, model: str, streams: int, max_tokens: int) -> dict:
    api = ResponsesAPI(base_url, model)
    all_gaps: list[float] = []
    async with httpx.AsyncClient(timeout=120.0) as client:
        for _ in range(streams):
            r = await api.stream(client, [{"role": "user", "content": "count"}], max_tokens)
            if r.error:
                return {"error": r.error}
            all_gaps.extend(g * 1000 for g in r.gaps())
    if not all_gaps:
        return {"error": "no gaps (fewer than 2 deltas)"}
    med = statistics.median(all_gaps)
    batched = sum(g < 5.0 for g in all_gaps) / len(all_gaps)
    return {
        "deltas": len(all_gaps) + streams,
        "median_gap_ms": med,
        "p10_gap_ms": percentile(all_gaps, 10),
        "p90_gap_ms": percentile(all_gaps, 90),
        "share_under_5ms": batched,
        "verdict": "ok: one delta per token" if abs(med - 20.0) <= 6.0 and batched < 0.25 else "CHECK: deltas batched or delayed",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=None, help="default 3; --quick: 1")
    p.add_argument("--quick", action="store_true", help="fewer requests (100 at 1 client, 640 at 64), 1 run")
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--serve-bare", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.serve_bare is None:
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    if opts.serve_bare is not None:
        serve_bare(opts.serve_bare)
        return 0
    if opts.runs is None:
        opts.runs = 1 if opts.quick else 3
    levels = [int(c) for c in opts.concurrency.split(",")]
    totals = {c: (100 if c == 1 else 10 * c) if opts.quick else (300 if c == 1 else 20 * c) for c in levels}

    kiln_spec = spec_for("kiln_scripted", scripted_delay=0.0, scripted_reply="ok")
    port = free_port()
    bare_spec = ServerSpec("bare", [sys.executable, "-m", "bench.gateway_overhead", "--serve-bare", str(port)], "bare", "kiln-scripted", port, dict(os.environ),
        note="Starlette on Hypercorn, canned JSON")
    results: dict[str, dict[int, list[dict]]] = {"bare": {c: [] for c in levels}, "kiln": {c: [] for c in levels}}
    with Server(bare_spec, log_dir=opts.log_dir) as bare, Server(kiln_spec, log_dir=opts.log_dir) as kiln:
        targets = {"bare": bare, "kiln": kiln}
        for run in range(opts.runs):
            for c in levels:
                for name, server in targets.items():
                    r = asyncio.run(load(server.spec.base_url, server.spec.model, c, totals[c]))
                    results[name][c].append(r)
                    progress(f"run {run + 1}/{opts.runs} {name} x{c}: p50 {r['p50_ms'] or 0:.2f} ms, p99 {r['p99_ms'] or 0:.2f} ms, {r['req_per_s'] or 0:.0f} req/s, {r['failed']} failed"
                        + (f" ({r['first_failure']})" if r["failed"] else ""))

    progress("inter-event gaps: scripted engine at 20 ms/token")
    gap_spec = spec_for("kiln_scripted", scripted_delay=0.02, scripted_reply="abcdefghij" * 6)
    with Server(gap_spec, log_dir=opts.log_dir) as server:
        gap = asyncio.run(gaps(server.spec.base_url, server.spec.model, 1 if opts.quick else 3, 60))

    print(f"\nGateway + protocol overhead — medians over {opts.runs} run(s); requests per run: " + ", ".join(f"{totals[c]} at {c}" for c in levels))
    header = f"{'clients':>7}  {'bare p50':>9}  {'kiln p50':>9}  {'added':>7}  {'bare p99':>9}  {'kiln p99':>9}  {'added':>7}  {'bare req/s':>10}  {'kiln req/s':>10}"
    print(header)
    print("-" * len(header))
    summary = {}
    for c in levels:
        row = {}
        for name in ("bare", "kiln"):
            for k in ("p50_ms", "p99_ms", "req_per_s"):
                row[f"{name}_{k}"] = median([r[k] for r in results[name][c]])
        summary[c] = row
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        add50 = None if None in (row["kiln_p50_ms"], row["bare_p50_ms"]) else row["kiln_p50_ms"] - row["bare_p50_ms"]
        add99 = None if None in (row["kiln_p99_ms"], row["bare_p99_ms"]) else row["kiln_p99_ms"] - row["bare_p99_ms"]
        print(f"{c:>7}  {f(row['bare_p50_ms']):>9}  {f(row['kiln_p50_ms']):>9}  {f(add50):>7}  {f(row['bare_p99_ms']):>9}  {f(row['kiln_p99_ms']):>9}  {f(add99):>7}  "
            f"{row['bare_req_per_s'] or 0:>10.0f}  {row['kiln_req_per_s'] or 0:>10.0f}")
    print("latencies in ms; 'added' = kiln - bare (gateway + ZeroMQ + worker protocol + store)")
    if "error" in gap:
        print(f"\nInter-event gaps (20 ms/token): ERROR {gap['error']}")
    else:
        print(f"\nInter-event gaps (20 ms/token): median {gap['median_gap_ms']:.1f} ms, p10 {gap['p10_gap_ms']:.1f}, p90 {gap['p90_gap_ms']:.1f}, "
              f"{gap['share_under_5ms'] * 100:.0f}% under 5 ms over {gap['deltas']} deltas -> {gap['verdict']}")
    if opts.json:
        opts.json.write_text(json.dumps({"runs": opts.runs, "totals": totals, "raw": results, "median": summary, "gaps": gap}, indent=2, default=str))
        print(f"\nwrote {opts.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
