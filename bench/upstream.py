"""What Kiln adds in front of an engine: llama-server's own chat endpoint vs the same llama-server
behind Kiln's gateway and ``kiln-worker --engine upstream`` (docs/upstream.md).

    python -m bench.upstream [--runs 3] [--tokens 64] [--threads 1]

One llama-server (the one bench/llama_cpp.py builds or finds) serves the bundled GGUF; one
``kiln serve --engine upstream`` fronts it. Each run streams the same chat request through both
doors with the same client (bench/client.py ChatAPI), alternating so that drift in the machine's
load hits both alike, after one warm-up each. The row: medians of TTFT and of decode time per
token (first to last text delta over the tokens after the first), and what Kiln adds to each.
The prompt differs per run only in its last words, so both doors see the same prefix-cache hits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

import httpx

from .client import ChatAPI, StreamResult
from .servers import Server, ServerSpec, _kiln_exe, free_port

MODEL = "smollm2-135m-instruct"
SLOTS, SLOT_CONTEXT = 2, 2048


def specs(threads: int) -> tuple[ServerSpec, ServerSpec]:
    from .convert import bundled_gguf
    from .llama_cpp import server_binary

    binary = server_binary()
    port = free_port()
    llama = ServerSpec("llama_cpp",
        [str(binary.path), "-m", str(bundled_gguf()), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(SLOTS), "-c", str(SLOTS * SLOT_CONTEXT),
            "--jinja", "--alias", MODEL, "--no-webui"], "chat", MODEL, port, note=f"llama-server {binary.version}: -t {threads}, -np {SLOTS}")
    kiln_port = free_port()
    upstream = ["--engine", "upstream", "--upstream", llama.base_url, "--upstream-kind", "llama-server", "--max-batch", str(SLOTS), "--context-length", str(SLOT_CONTEXT)]
    kiln = ServerSpec("kiln_upstream", [*_kiln_exe(), "serve", "--port", str(kiln_port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}", *upstream], "responses", MODEL, kiln_port,
        env=dict(os.environ), note="kiln serve --engine upstream, through /v1/chat/completions")
    return llama, kiln


async def one(api: ChatAPI, run: int, tokens: int) -> StreamResult:
    messages = [{"role": "user", "content": f"Count from 1 to 300, separated by commas. (run {run})"}]
    async with httpx.AsyncClient() as client:
        result = await api.stream(client, messages, tokens, temperature=0.0)
    if not result.ok:
        raise RuntimeError(result.error)
    return result


def per_token_ms(result: StreamResult) -> float | None:
    if result.first_delta is None or len(result.delta_times) < 2 or result.tokens < 2:
        return None
    return (result.delta_times[-1] - result.first_delta) / (result.tokens - 1) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--threads", type=int, default=1, help="llama-server's -t (1 on a shared machine: see bench/__main__.py --threads)")
    args = parser.parse_args(argv)
    llama_spec, kiln_spec = specs(args.threads)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "kiln-bench-upstream"
    with Server(llama_spec, log_dir=log_dir), Server(kiln_spec, log_dir=log_dir):
        direct = ChatAPI(llama_spec.base_url, MODEL)
        kiln = ChatAPI(kiln_spec.base_url, MODEL)
        results: dict[str, list[StreamResult]] = {"direct": [], "kiln": []}
        asyncio.run(one(direct, -1, args.tokens))  # warm-ups
        asyncio.run(one(kiln, -1, args.tokens))
        for run in range(args.runs):
            results["direct"].append(asyncio.run(one(direct, run, args.tokens)))
            results["kiln"].append(asyncio.run(one(kiln, run, args.tokens)))
    ttft = {k: statistics.median(r.ttft * 1000 for r in v if r.ttft is not None) for k, v in results.items()}
    tpot = {k: statistics.median(x for x in map(per_token_ms, v) if x is not None) for k, v in results.items()}
    counts = {k: [r.tokens for r in v] for k, v in results.items()}
    load = os.getloadavg()[0]
    print(f"# {llama_spec.note}; {kiln_spec.note}; {args.runs} runs, max_tokens {args.tokens}; output tokens direct {counts['direct']}, kiln {counts['kiln']}; load {load:.1f}", file=sys.stderr)
    print("| door | TTFT ms (median) | decode ms/token (median) |")
    print("| --- | --- | --- |")
    print(f"| llama-server /v1/chat/completions | {ttft['direct']:.1f} | {tpot['direct']:.2f} |")
    print(f"| Kiln gateway + upstream worker, /v1/chat/completions | {ttft['kiln']:.1f} | {tpot['kiln']:.2f} |")
    print(f"| added by Kiln | {ttft['kiln'] - ttft['direct']:+.1f} | {tpot['kiln'] - tpot['direct']:+.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
