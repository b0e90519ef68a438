"""What speculative decoding by prompt lookup wins, and what it costs: `python -m bench.speculative`.

    python -m bench.speculative [--quick] [--runs N] [--modes off,auto,on] [--threads N] [--json FILE]

Each run starts `kiln serve --speculative MODE` on the bundled model once per mode (the order
rotating run by run, so drift in machine load hits every mode alike), warms it up, and runs two
workloads of bench/workloads.py at temperature 0:

- ``agent_edit``: a ~600-token source file and "rewrite it with one change", so the answer copies
  most of the prompt: where drafts are accepted;
- ``single`` with 128 output tokens: ordinary prose, where drafts are rarely right and ``auto``
  should cost next to nothing.

For each it reports the median over runs of decode tok/s and the tokens per decode step (the
worker's counters in /metrics: ``kiln_worker_decode_tokens_total`` over
``kiln_worker_decode_steps_total``), and the draft acceptance. Greedy output does not depend on
speculation, so every mode's texts must be the same as ``off``'s for the same prompts: a
difference is printed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

from kiln.protocol import HEARTBEAT_INTERVAL_S

from . import workloads as wl
from .client import make_api, median
from .servers import Server, spec_for

MODES = ("off", "auto", "on")
WORKLOADS = ("agent_edit", "single")
PROSE_OUTPUT_TOKENS = 128
_COUNTERS = ("decode_tokens", "decode_steps", "draft_tokens", "accepted_draft_tokens")


def progress(msg: str) -> None:
    print(f"[speculative {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """The workers' decode counters, summed, once the latest heartbeat has carried them."""
    await asyncio.sleep(2 * HEARTBEAT_INTERVAL_S)
    text = (await client.get(base_url + "/metrics")).text
    out = dict.fromkeys(_COUNTERS, 0.0)
    for name in _COUNTERS:
        for value in re.findall(rf"^kiln_worker_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M):
            out[name] += float(value)
    return out


async def one_run(server: Server, cfg: wl.Config, run: int) -> tuple[dict[str, float | None], dict[str, list[str]], list[str]]:
    spec = server.spec
    api = make_api(spec.api, spec.base_url, spec.model)
    async with httpx.AsyncClient(timeout=cfg.timeout) as client:
        warm = await api.stream(client, [{"role": "user", "content": "Hello! Who are you?"}], 4, 0.0, cfg.timeout)
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        ctx = wl.Context(api=api, client=client, cfg=cfg, run=run, progress=lambda m: progress(f"{spec.name} run {run + 1}: {m.strip()}"))
        metrics: dict[str, float | None] = {}
        before = await counters(client, spec.base_url)
        for name in WORKLOADS:
            metrics.update(await wl.RUNNERS[name](ctx))
            after = await counters(client, spec.base_url)
            delta = {k: after[k] - before[k] for k in _COUNTERS}
            before = after
            metrics[f"{name}.tokens_per_step"] = delta["decode_tokens"] / delta["decode_steps"] if delta["decode_steps"] else None
            metrics[f"{name}.draft_acceptance"] = delta["accepted_draft_tokens"] / delta["draft_tokens"] if delta["draft_tokens"] else None
        return metrics, ctx.texts, ctx.errors


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=None, help="runs per mode (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="one agent edit of 128 tokens, one prose answer")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from %(default)s")
    p.add_argument("--threads", type=int, default=None, help="the worker's compute threads (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS)")
    p.add_argument("--json", type=Path, default=None, help="every run's metrics, the medians, mismatches")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp folder)")
    opts = p.parse_args(argv)
    if opts.runs is None:
        opts.runs = 1 if opts.quick else 3
    return opts


def table(modes: list[str], medians: dict[str, dict[str, float | None]]) -> str:
    metrics = sorted({m for mode in modes for m in medians[mode]}, key=lambda m: (WORKLOADS.index(m.split(".")[0]) if m.split(".")[0] in WORKLOADS else 9, m))
    fmt = lambda v: "—" if v is None else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"  # noqa: E731
    head = "| metric | " + " | ".join(modes) + " | " + " | ".join(f"{m} / off" for m in modes if m != "off") + " |"
    lines = [head, "|" + "---|" * (1 + len(modes) + len([m for m in modes if m != "off"]))]
    for metric in metrics:
        values = [medians[mode].get(metric) for mode in modes]
        base = medians.get("off", {}).get(metric)
        ratios = [medians[mode].get(metric) / base if base and medians[mode].get(metric) is not None else None for mode in modes if mode != "off"]
        lines.append(f"| {metric} | " + " | ".join(fmt(v) for v in values) + " | " + " | ".join("—" if r is None else f"{r:.2f}x" for r in ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            sys.exit(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    cfg = replace(wl.Config.quick() if opts.quick else wl.Config(), output_tokens=PROSE_OUTPUT_TOKENS, single_reps=1 if opts.quick else 2)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    texts: dict[tuple[int, str], dict[str, list[str]]] = {}
    errors: list[str] = []
    for run in range(opts.runs):
        for mode in modes[run % len(modes) :] + modes[: run % len(modes)]:
            spec = spec_for("kiln", kiln_args=["--speculative", mode], threads=opts.threads)
            spec.name = f"kiln --speculative {mode}"
            progress(f"{spec.name} run {run + 1}/{opts.runs}: starting")
            with Server(spec, log_dir=opts.log_dir) as server:
                metrics, got, errs = asyncio.run(one_run(server, cfg, run))
            runs[mode].append(metrics)
            texts[(run, mode)] = got
            errors.extend(f"{mode} run {run + 1}: {e}" for e in errs)
    medians = {m: {k: median([r.get(k) for r in runs[m]]) for k in {k for r in runs[m] for k in r}} for m in modes}
    mismatches = []
    if "off" in modes:
        for run in range(opts.runs):
            for mode in modes:
                for name, answers in texts[(run, mode)].items():
                    for i, (a, b) in enumerate(zip(answers, texts[(run, "off")].get(name, []), strict=False)):
                        if a != b:
                            mismatches.append(f"run {run + 1} {name} #{i + 1}: {mode} differs from off:\n  {mode}: {a[:200]!r}\n  off:  {b[:200]!r}")
    print(table(modes, medians))
    print(f"\nmedians of {opts.runs} run(s); greedy texts identical across modes: {'yes' if not mismatches else 'NO'}")
    for m in mismatches + errors:
        print(m)
    if opts.json:
        opts.json.write_text(json.dumps({"runs": runs, "medians": medians, "mismatches": mismatches, "errors": errors, "config": vars(cfg)}, indent=2, default=str))
    return 1 if mismatches or errors else 0


if __name__ == "__main__":
    sys.exit(main())
