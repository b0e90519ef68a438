"""Hostile traffic against a real Kiln on loopback, with the figures the hardening issue asks for:
`python -m bench.reliability` (about two minutes on 2 cores).

It starts a gateway and one worker on the bundled model (real weights) in local mode, and runs:
bad inputs (each answered 400, never a 5xx or a hang), load (a 10 MB prompt, 50 x 1 MB prompts,
40 connections declaring 30 MiB bodies, 50 clients dribbling a body) while a normal stream runs,
and faults (a client that cuts its stream, a bad seed among good requests). For each step it
prints what was answered and the gateway's and worker's RSS before and after. This is a report,
not a test: the assertions live in tests/ (test_edge_*, test_fuzz_create, test_worker_reliability_*).
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.support import Kiln

MODEL = "smollm2-135m-instruct"
HEADERS = {"content-type": "application/json"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def progress(msg: str) -> None:
    print(f"[reliability {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


BAD_INPUTS: dict[str, bytes] = {
    "int >= 2^64 in user": b'{"model":"%s","input":"hi","user":18446744073709551616}',
    "lone surrogate": b'{"model":"%s","input":"\\ud800"}',
    "JSON nested 100,000 deep": b'{"model":"%s","input":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "NaN in reasoning": b'{"model":"%s","input":"hi","reasoning":{"effort":NaN}}',
    "NaN in text": b'{"model":"%s","input":"hi","text":{"verbosity":NaN}}',
    "5,000-deep tool schema": b'{"model":"%s","input":"hi","tools":[{"type":"function","name":"f","parameters":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}]}",
    "seed -1": b'{"model":"%s","input":"hi","seed":-1}',
    "seed 1.5": b'{"model":"%s","input":"hi","seed":1.5}',
    "seed 2^70": b'{"model":"%s","input":"hi","seed":1180591620717411303424}',
    'seed "x"': b'{"model":"%s","input":"hi","seed":"x"}',
    "max_output_tokens 2^63": b'{"model":"%s","input":"hi","max_output_tokens":9223372036854775808}',
    "max_output_tokens 2^62": b'{"model":"%s","input":"hi","max_output_tokens":4611686018427387904}',
    "top_logprobs 100": b'{"model":"%s","input":"hi","top_logprobs":100}',
    "temperature Infinity": b'{"model":"%s","input":"hi","temperature":Infinity}',
    "not JSON": b"{not json",
    "text/plain body": b"__text__",
}


async def bad_inputs(kiln: Kiln) -> list[tuple[str, str, int, int]]:
    rows = []
    async with httpx.AsyncClient(base_url=kiln.base_url, timeout=30) as c:
        for name, raw in BAD_INPUTS.items():
            body = raw.replace(b"%s", MODEL.encode()) if b"%s" in raw else raw
            headers = HEADERS
            if raw == b"__text__":
                body, headers = b'{"model":"%s","input":"hi"}' % MODEL.encode(), {"content-type": "text/plain"}
            five, hangs, statuses = 0, 0, collections.Counter()
            for _ in range(3):
                try:
                    r = await c.post("/v1/responses", content=body, headers=headers)
                    statuses[r.status_code] += 1
                    five += r.status_code >= 500
                except httpx.TimeoutException:
                    hangs += 1
            rows.append((name, ", ".join(f"{k}x{v}" for k, v in sorted(statuses.items())), five, hangs))
        r = await c.get("/v1/usage", params={"start_time": "1e20"})
        rows.append(("/v1/usage start_time=1e20 (local: no such route)", str(r.status_code), int(r.status_code >= 500), 0))
    return rows


async def normal_stream(kiln: Kiln) -> str:
    async with httpx.AsyncClient(base_url=kiln.base_url, timeout=120) as c:
        async with c.stream("POST", "/v1/responses", json={"model": MODEL, "input": "Count to twenty.", "max_output_tokens": 48, "stream": True, "temperature": 0}) as r:
            last = ""
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = json.loads(line[6:])["type"]
            return last


async def big_prompts(kiln: Kiln, size: int, count: int, concurrency: int) -> collections.Counter:
    body = json.dumps({"model": MODEL, "input": "word " * (size // 5), "max_output_tokens": 8}).encode()
    statuses: collections.Counter = collections.Counter()
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=kiln.base_url, timeout=120) as c:
        async def one() -> None:
            async with sem:
                try:
                    r = await c.post("/v1/responses", content=body, headers=HEADERS)
                    statuses[f"{r.status_code} {r.json().get('error', {}).get('code') if r.status_code != 200 else ''}".strip()] += 1
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1
        await asyncio.gather(*(one() for _ in range(count)))
    return statuses


def declared_bodies(kiln: Kiln, count: int = 40) -> collections.Counter:
    """Connections declaring 30 MiB bodies that send 1 MiB and stall."""
    socks, answers = [], collections.Counter()
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", kiln.port), timeout=60)
            s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 31457280\r\n\r\n" + b" " * (1 << 20))
            socks.append(s)
        for s in socks:
            try:
                answers[s.recv(64).split(b"\r\n")[0].decode() or "closed"] += 1
            except OSError as exc:
                answers[type(exc).__name__] += 1
    finally:
        for s in socks:
            s.close()
    return answers


def dribblers(kiln: Kiln, count: int = 50, seconds: float = 40) -> collections.Counter:
    """Clients sending one body byte every 5 s: the body deadline (30 s) must end each."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", kiln.port), timeout=5)
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        s.setblocking(False)
        socks.append(s)
    ended: collections.Counter = collections.Counter()
    deadline = time.monotonic() + seconds
    open_socks = list(socks)
    while open_socks and time.monotonic() < deadline:
        time.sleep(5)
        for s in list(open_socks):
            try:
                data = s.recv(64)
                ended[data.split(b"\r\n")[0].decode() or "closed"] += 1
                open_socks.remove(s)
                continue
            except BlockingIOError:
                pass
            except OSError:
                ended["closed"] += 1
                open_socks.remove(s)
                continue
            try:
                s.send(b" ")
            except OSError:
                ended["closed"] += 1
                open_socks.remove(s)
    ended["still open"] = len(open_socks)
    for s in socks:
        s.close()
    return ended


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kiln-reliability-"))
    progress(f"starting gateway + worker on the bundled model (logs in {tmp})")
    kiln = Kiln(tmp, gateway_args=["--max-body-bytes", str(32 << 20)], worker_args=["--max-batch", "4"]).start()
    gw, wk = kiln.gateway.process.pid, kiln.worker_procs[0].process.pid
    loads: list[tuple[str, str, float, float, float, float]] = []

    def measure(name: str, action) -> None:
        before = (rss_mib(gw), rss_mib(wk))
        progress(name)
        outcome = action()
        after = (rss_mib(gw), rss_mib(wk))
        loads.append((name, str(outcome), before[0], after[0], before[1], after[1]))

    try:
        rows = asyncio.run(bad_inputs(kiln))

        async def with_stream(coro):
            stream = asyncio.create_task(normal_stream(kiln))
            result = await coro
            return f"{dict(result)}; concurrent stream ended {await stream}"

        measure("10 MB prompt during a stream", lambda: asyncio.run(with_stream(big_prompts(kiln, 10 << 20, 1, 1))))
        measure("50 x 1 MB prompts during a stream", lambda: asyncio.run(with_stream(big_prompts(kiln, 1 << 20, 50, 8))))
        measure("40 connections declaring 30 MiB bodies", lambda: dict(declared_bodies(kiln)))
        measure("50 clients dribbling a body byte every 5 s", lambda: dict(dribblers(kiln)))
        measure("a normal request afterwards", lambda: asyncio.run(normal_stream(kiln)))
        dropped = "stopped heartbeating" in kiln.gateway.log_path.read_text()
    finally:
        kiln.stop()

    print("\n| bad input (3 tries each) | answers | 5xx | hangs |\n|---|---|---|---|")
    for name, answers, five, hangs in rows:
        print(f"| {name} | {answers} | {five} | {hangs} |")
    print("\n| load | outcome | gateway RSS MiB before -> after | worker RSS MiB before -> after |\n|---|---|---|---|")
    for name, outcome, g0, g1, w0, w1 in loads:
        print(f"| {name} | {outcome} | {g0:.0f} -> {g1:.0f} | {w0:.0f} -> {w1:.0f} |")
    print(f"\nworker dropped by the gateway at any point: {'yes' if dropped else 'no'}")


if __name__ == "__main__":
    main()
