"""Kiln against other local servers on the same weights: `python -m bench` (or `./dev bench`).

For each run and each peer: start the server, warm it up, run the workloads, stop it. Peers are
interleaved run by run so that drift in machine load hits all of them alike. The table shows the
median of each metric over the runs and the ratios Kiln/peer (for `kiln` and, where it runs,
`kiln_chat`: Kiln through /v1/chat/completions). With `--model-shape`, Kiln and llama-server
serve random-weight GGUFs of real models' shapes (bench/model_shapes.py), one table per file and
thread count. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

import httpx

from . import llama_cpp, model_shapes
from . import workloads as wl
from .client import make_api, median
from .servers import ALL_PEERS, PEERS, ModelFile, PeerUnavailable, Server, ServerSpec, spec_for

SHAPE_PEERS = ("kiln", "llama_cpp")
SHAPE_THREADS = (1, 2)


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", default=None, help=f"comma-separated, from {', '.join(ALL_PEERS)} (default: {','.join(PEERS)}; with --model-shape {','.join(SHAPE_PEERS)}); unavailable ones are skipped")
    p.add_argument("--runs", type=int, default=None, help="runs per peer; the table shows medians (default 3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="smaller workloads (32 output tokens, 1 and 4 streams, 3 turns, 256-token system prompt) and 1 run")
    p.add_argument("--workloads", default=None, help=f"comma-separated, from {','.join(wl.RUNNERS)} (default: {','.join(wl.WORKLOADS)}; with --model-shape {','.join(wl.SHAPE_WORKLOADS)})")
    p.add_argument("--model-shape", default=None,
        help=f"comma-separated, from {', '.join(model_shapes.SHAPES)}: serve a random-weight GGUF of that model's exact shape (SmolLM2's tokenizer), written and quantized by llama.cpp's "
            "llama-quantize once (cached), on kiln and llama_cpp; one table per file and thread count")
    p.add_argument("--quant", default=",".join(model_shapes.DEFAULT_QUANTS),
        help=f"with --model-shape: comma-separated llama-quantize types, from {', '.join(model_shapes.QUANTS)} (default %(default)s)")
    p.add_argument("--shape-layers", type=int, default=None, help="with --model-shape: this many decoder blocks instead of the model's (a quicker file; the name says so)")
    p.add_argument("--plain-rope", action="store_true", help="with --model-shape: write Llama 3 shapes without their rope_freqs tensor (plain RoPE at the same base; the name says so)")
    p.add_argument("--cpu", choices=llama_cpp.CPU_LEVELS, default="native",
        help="avx2: Kiln's AVX2 kernels against llama-server built without AVX-VNNI and AVX-512, as on a CPU without them (AMD before Zen 4, Intel clients before Alder Lake)")
    p.add_argument("--json", type=Path, default=None, help="write every run's metrics and the medians here")
    p.add_argument("--scripted-delay", type=float, default=0.01, help="seconds per token of kiln_scripted (default %(default)s)")
    p.add_argument("--threads", default=None,
        help="compute threads for every peer: llama-server's -t, OMP_NUM_THREADS and OPENBLAS_NUM_THREADS; comma-separated for one table per count (default: the usable core count; with "
            "--model-shape 1,2); 1 on a machine shared with other work, where spinning threads that wait for a descheduled one make 2 threads far slower than 1")
    p.add_argument("--blas-threads", type=int, default=None, help="OPENBLAS_NUM_THREADS alone for every peer (default: --threads, else each server's own, the usable core count)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp folder)")
    p.add_argument("--kiln-arg", action="append", default=[],
        help="extra argument for `kiln serve` (repeatable), e.g. --kiln-arg=--model --kiln-arg=PATH to serve the same folder the mlx_lm peers use")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for a server to come up")
    p.add_argument("--ratios", default=None, help="comma-separated peers whose medians are divided by the others' (default: kiln and kiln_chat where they ran, else kiln_scripted)")
    opts = p.parse_args(argv)
    if opts.runs is None:
        opts.runs = 1 if opts.quick else 3
    shaped = opts.model_shape is not None
    try:
        if opts.shape_layers is not None and opts.shape_layers < 1:
            raise ValueError("--shape-layers must be at least 1")
        opts.shapes = [model_shapes.select(s, opts.shape_layers, opts.plain_rope) for s in model_shapes.parse_list(opts.model_shape, model_shapes.SHAPES, "model shape")] if shaped else []
        opts.quants = model_shapes.parse_list(opts.quant, model_shapes.QUANTS, "quantization") if shaped else []
        opts.thread_counts = parse_threads(opts.threads) if opts.threads else (list(SHAPE_THREADS) if shaped else [None])
    except ValueError as exc:
        p.error(str(exc))
    if opts.peers is None:
        opts.peers = ",".join(SHAPE_PEERS if shaped else PEERS)
    if opts.workloads is None:
        opts.workloads = ",".join(wl.SHAPE_WORKLOADS if shaped else wl.WORKLOADS)
    return opts


def parse_threads(text: str) -> list[int | None]:
    """`--threads 1,2`: the thread counts, one table each."""
    out: list[int | None] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--threads takes positive integers, not {item!r}")
        out.append(int(item))
    if not out:
        raise ValueError("--threads is empty")
    return out


async def run_peer_once(server: Server, cfg: wl.Config, names: list[str], run: int, started: float | None = None) -> tuple[dict, list[str]]:
    """The warm-up request, then the workloads. `started` (perf_counter at the server's start):
    `load.first_reply_s` is the time from it to the warm-up's last token, which includes whatever
    a server still does after it says it is ready (Kiln's native build check)."""
    spec = server.spec
    api = make_api(spec.api, spec.base_url, spec.model, spec.exact_length)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout) as client:
        warm = await api.stream(client, [{"role": "user", "content": "Hello! Who are you?"}], 4, 0.0, cfg.timeout)
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        ctx = wl.Context(api=api, client=client, cfg=cfg, run=run, progress=lambda m: progress(f"{spec.name} run {run + 1}: {m.strip()}"))
        metrics: dict = {"load.rss_mb": server.rss_mb()[0]}
        if started is not None:
            metrics["load.first_reply_s"] = warm.end - started
        for name in names:
            started = time.perf_counter()
            progress(f"{spec.name} run {run + 1}: {name}")
            metrics.update(await wl.RUNNERS[name](ctx))
            progress(f"{spec.name} run {run + 1}: {name} done in {time.perf_counter() - started:.0f} s")
        return metrics, ctx.errors


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)


def ratio_pairs(peers: list[str], bases: list[str]) -> list[tuple[str, str]]:
    """(base, peer) for each ratio column: each base against every peer that is not an earlier base.

    With bases kiln, kiln_chat: kiln against all others (kiln_chat included: what the Chat door
    costs), then kiln_chat against the other chat servers.
    """
    pairs = []
    for i, base in enumerate(bases):
        pairs += [(base, p) for p in peers if p != base and p not in bases[:i]]
    return pairs


def default_bases(medians: dict[str, dict]) -> list[str]:
    bases = [b for b in ("kiln", "kiln_chat") if b in medians]
    return bases or (["kiln_scripted"] if "kiln_scripted" in medians else [])


def table(peers: list[str], medians: dict[str, dict], bases: list[str]) -> str:
    metrics: list[str] = []
    for peer in peers:
        for key in medians.get(peer, {}):
            if key not in metrics:
                metrics.append(key)
    pairs = ratio_pairs([p for p in peers if p in medians], [b for b in bases if b in medians])
    header = ["metric", *peers, *[f"{a}/{b}" for a, b in pairs]]
    rows = [header]
    for m in metrics:
        row = [m + {True: " ↑", False: " ↓", None: ""}[wl.higher_is_better(m)]]
        row += [fmt(medians.get(p, {}).get(m)) for p in peers]
        for base, p in pairs:
            a, b = medians[base].get(m), medians[p].get(m)
            row.append(f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[j]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(r)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def token_mismatches(peers: list[str], medians: dict[str, dict], tolerance: float = 0.05) -> list[str]:
    """Token-count rows where the peers differ by more than `tolerance`: their rates are then over different lengths."""
    out = []
    keys = dict.fromkeys(k for p in peers for k in medians.get(p, {}) if k.endswith(("output_tokens", "input_tokens")))
    for key in keys:
        values = {p: medians[p][key] for p in peers if isinstance(medians.get(p, {}).get(key), (int, float))}
        if len(values) > 1 and max(values.values()) > (1 + tolerance) * min(values.values()):
            out.append(f"{key}: " + ", ".join(f"{p} {fmt(v)}" for p, v in values.items()))
    return out


def _interrupt(*_) -> None:
    raise KeyboardInterrupt  # unwinds through `with Server(...)`, which stops the servers


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    opts = parse_args(argv)
    peers = [p.strip() for p in opts.peers.split(",") if p.strip()]
    names = [w.strip() for w in opts.workloads.split(",") if w.strip()]
    for p in peers:
        if p not in ALL_PEERS:
            sys.exit(f"unknown peer {p!r}; choose from {', '.join(ALL_PEERS)}")
    for n in names:
        if n not in wl.RUNNERS:
            sys.exit(f"unknown workload {n!r}; choose from {', '.join(wl.RUNNERS)}")
    ratio_bases = [b.strip() for b in opts.ratios.split(",") if b.strip()] if opts.ratios else None
    for b in ratio_bases or []:
        if b not in peers:
            sys.exit(f"--ratios names {b!r}, which is not among --peers")
    shaped = bool(opts.shapes)
    cfg = wl.Config.model_shape(opts.quick) if shaped else wl.Config.quick() if opts.quick else wl.Config()
    models: list[ModelFile | None] = [None]
    if shaped:
        models = [ModelFile(model_shapes.ensure(shape, quant, log=progress), f"{shape.name}-{quant.lower()}") for shape in opts.shapes for quant in opts.quants]
    report: list[dict] = []
    status = 1
    for model in models:
        for threads in opts.thread_counts:
            title = f"{model.id}, {model.path.stat().st_size / 1e6:.0f} MB, " if model else ""
            title += f"{threads} thread(s)" if threads else "default threads"
            title += f", as an {opts.cpu.upper()} CPU" if opts.cpu != "native" else ""
            result = run_configuration(opts, cfg, peers, names, ratio_bases, model, threads, title)
            report.append(result)
            status = min(status, 0 if result["shown"] else 1)
    if opts.json:
        opts.json.write_text(json.dumps({
            "config": {**vars(cfg), "runs": opts.runs, "quick": opts.quick, "workloads": names},
            "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpu": opts.cpu},
            **(report[0] if len(report) == 1 else {"tables": report}),
        }, indent=2, default=str))
        print(f"\nwrote {opts.json}")
    return status


def run_configuration(opts: argparse.Namespace, cfg: wl.Config, peers: list[str], names: list[str], ratio_bases: list[str] | None, model: ModelFile | None, threads: int | None, title: str) -> dict:
    """One table: every peer on `model` (None: each its default weights) with `threads`, runs interleaved."""

    def spec(p: str) -> ServerSpec:
        return spec_for(p, scripted_delay=opts.scripted_delay, blas_threads=opts.blas_threads, threads=threads, kiln_args=opts.kiln_arg, model=model, cpu=opts.cpu)

    specs_ok: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for p in peers:
        try:
            specs_ok[p] = spec(p).note
        except PeerUnavailable as exc:
            skipped[p] = str(exc)
            progress(f"skipping {p}: {exc}")
    active = [p for p in peers if p in specs_ok]
    if not active:
        sys.exit("no peer can run here")
    progress(f"{title}: peers {', '.join(active)}; workloads {', '.join(names)}; {opts.runs} run(s){' (quick)' if opts.quick else ''}")

    runs: dict[str, list[dict]] = {p: [] for p in active}
    errors: dict[str, list[str]] = {p: [] for p in active}
    started = time.perf_counter()
    for run in range(opts.runs):
        for p in active:
            s = spec(p)  # fresh ports each start
            progress(f"{p} run {run + 1}/{opts.runs}: starting ({s.note})")
            t0 = time.perf_counter()
            try:
                with Server(s, log_dir=opts.log_dir, ready_timeout=opts.ready_timeout) as server:
                    ready = time.perf_counter() - t0
                    progress(f"{p} run {run + 1}/{opts.runs}: ready in {ready:.0f} s; warming up")
                    metrics, errs = asyncio.run(run_peer_once(server, cfg, names, run, started=t0))
                    peak = server.rss_mb()[1]
                    metrics = {"load.ready_s": ready, **metrics, "load.peak_rss_mb": peak}
                    if errs:
                        progress(f"{p} run {run + 1}: {len(errs)} failed request(s); first: {errs[0][:200]}; log {server.log_path}")
            except RuntimeError as exc:
                progress(f"{p} run {run + 1}: FAILED: {exc}")
                errors[p].append(str(exc)[:500])
                continue
            runs[p].append(metrics)
            errors[p].extend(errs)
    elapsed = time.perf_counter() - started

    medians: dict[str, dict] = {}
    for p, rs in runs.items():
        if not rs:
            continue
        keys = [k for r in rs for k in r]
        medians[p] = {k: median([r.get(k) for r in rs]) for k in dict.fromkeys(keys)}
    bases = ratio_bases or default_bases(medians)
    shown = [p for p in active if p in medians]

    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nKiln benchmark — {title}; medians over {opts.runs} run(s){' (quick)' if opts.quick else ''}, {platform.machine()} {platform.system()}, {elapsed:.0f} s, load average at the end {load}")
    for p in active:
        print(f"  {p}: {specs_ok[p]}; {len(runs[p])} run(s) ok, {len(errors[p])} error(s)")
    for p, why in skipped.items():
        print(f"  {p}: skipped ({why})")
    if shown:
        print()
        print(table(shown, medians, bases))
        print("\n↑ higher is better, ↓ lower is better; a/b columns are a's median over b's median.")
        print("load.rss_mb: resident memory of the process holding the model (Kiln's worker, llama-server) after the warm-up request; load.peak_rss_mb: its peak by the end of the run.")
        mismatches = token_mismatches(shown, medians)
        if mismatches:
            print("Token counts differ between peers (rates below are over different lengths):")
            for line in mismatches:
                print(f"  {line}")
    return {
        "title": title,
        "model": str(model.path) if model else None,
        "threads": threads,
        "peers": {p: {"note": specs_ok[p], "runs": runs[p], "median": medians.get(p), "errors": errors[p]} for p in active},
        "skipped": skipped,
        "elapsed_s": elapsed,
        "shown": shown,
    }


if __name__ == "__main__":
    raise SystemExit(main())
