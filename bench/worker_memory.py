"""Worker memory over one long WebSocket session (issue 30, item 7): the worker's resident set and
its prefix cache's byte total after every turn, against a real Kiln with the bundled model.

Each turn continues the last through previous_response_id and adds a tool call and its output,
as an agent loop does, so the prompt grows turn by turn. A worker whose memory only follows its
bounded caches levels off; one that keeps something per turn climbs. This is a report, not a
test. Run: ``.venv/bin/python -m bench.worker_memory [--turns 60] [--cache-bytes N]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx
import websockets.sync.client

from bench.reliability import rss_mib
from bench.websocket_session import INSTRUCTIONS, MODEL, TOOL, tool_turn
from tests.support import Kiln


def cache_mib(base: str) -> tuple[float, float]:
    """The worker's prefix-cache byte total and what mlx holds, as its heartbeat reports them
    (/health), in MiB."""
    figures = httpx.get(base + "/health", timeout=10).json()["workers"][0]["cache"]
    return (figures.get("cache_bytes") or 0) / 2**20, (figures.get("mlx_active_bytes") or 0) / 2**20


def session(base: str, worker_pid: int, turns: int, max_tokens: int) -> list[tuple[int, int, float, tuple[float, float]]]:
    """(turn, prompt tokens, worker RSS MiB, (prefix cache, mlx active) MiB) after each turn of
    one socket."""
    rows = []
    previous = None
    with websockets.sync.client.connect(base.replace("http", "ws", 1) + "/v1/responses", max_size=None) as ws:
        for i in range(turns):
            new = ([{"role": "user", "content": "Look at the project and summarise it."}] if i == 0 else []) + tool_turn(i)
            body = {"type": "response.create", "model": MODEL, "instructions": INSTRUCTIONS, "input": new, "tools": [TOOL], "max_output_tokens": max_tokens, "temperature": 0, "store": False}
            if previous:
                body["previous_response_id"] = previous
            ws.send(json.dumps(body))
            while True:
                event = json.loads(ws.recv())
                if event["type"] == "error":
                    raise SystemExit(f"turn {i}: {event}")
                if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    previous = event["response"]["id"]
                    tokens = event["response"]["usage"]["input_tokens"]
                    break
            time.sleep(1.2)  # one heartbeat, so /health has this turn's cache figure
            rows.append((i + 1, tokens, rss_mib(worker_pid), cache_mib(base)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cache-bytes", type=int, default=None, help="the worker's --cache-bytes (default: its own)")
    args = parser.parse_args()
    extra = ["--cache-bytes", str(args.cache_bytes)] if args.cache_bytes is not None else []
    with tempfile.TemporaryDirectory() as tmp:
        server = Kiln(Path(tmp), worker_args=extra).start()
        try:
            pid = server.worker_procs[0].process.pid
            start = rss_mib(pid)
            rows = session(server.base_url, pid, args.turns, args.max_tokens)
        finally:
            server.stop()
    print(f"worker RSS at start: {start:.0f} MiB ({MODEL}, CPU, one WebSocket, {args.turns} turns)")
    print("| turn | input tokens | worker RSS MiB | prefix cache MiB | mlx active MiB |\n|---|---|---|---|---|")
    for turn, tokens, rss, (cache, active) in rows:
        print(f"| {turn} | {tokens} | {rss:.0f} | {cache:.1f} | {active:.0f} |")


if __name__ == "__main__":
    main()
