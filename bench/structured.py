"""What structured output costs, and whether it holds: `python -m bench.structured`.

    python -m bench.structured [--quick] [--runs N] [--sweep N [--schemas K|a,b]] [--json FILE]

Against one freshly started `kiln serve` on the bundled model:

1. Decode overhead. The same prompt and `max_output_tokens` streamed with and without a
   `json_schema` `text.format` (a string with a `minLength`, so both generate to the cap),
   temperature 0, interleaved. Every constrained step fills an llguidance token mask and applies
   it to the logits; the median decode tok/s with over without says what that costs (target:
   under 10 %).
2. Grammar compile. TTFT with a schema the worker has never seen (made unique per request by an
   optional property with a random name, so its cache key, the canonical JSON of the format,
   is new) against the same schema sent again (compiled grammar from the worker's cache), and
   the same prompt without a schema for reference. The prompt is the same for all, and its
   prefix is cached, so the differences are the grammar's.
3. `--sweep N`: each schema of tests/data/schemas, N times at temperature 1.0 with
   `max_output_tokens` 600, up to 8 requests at once. A `completed` response must parse and
   validate (Draft 2020-12 with format checks); `incomplete` means it hit the token cap. Any
   invalid completed output is a bug: it is printed and the exit status is 1.

Progress goes to stderr, the tables to stdout. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from .client import Message, ResponsesAPI, StreamResult, median
from .servers import REPO, Server, spec_for

SCHEMA_DIR = REPO / "tests" / "data" / "schemas"
DECODE_PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
DECODE_SCHEMA = {  # at least 400 characters (~80 tokens) of story: the cap is always reached
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400}},
    "required": ["story"],
    "additionalProperties": False,
}
TTFT_SCHEMA_NAME = "restaurant_menu"  # the largest schema of the set, with $defs
TTFT_OUTPUT_TOKENS = 8
SWEEP_OUTPUT_TOKENS = 600
MIN_DECODE_TOKENS = 32


def progress(msg: str) -> None:
    print(f"[structured {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class FormatAPI(ResponsesAPI):
    """Kiln's Responses API with a `text.format` in every request body."""

    def __init__(self, base_url: str, model: str, text_format: dict[str, Any] | None) -> None:
        super().__init__(base_url, model)
        self.text_format = text_format

    def body(self, messages, max_tokens, temperature, stream=True):
        body = super().body(messages, max_tokens, temperature, stream)
        if self.text_format is not None:
            body["text"] = {"format": self.text_format}
        return body


def json_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "name": name, "schema": schema, "strict": True}


def load_cases() -> list[dict[str, Any]]:
    """The 50 {"name", "prompt", "schema"} cases the e2e tests use."""
    return [json.loads(p.read_text()) for p in sorted(SCHEMA_DIR.glob("*.json"))]


def unique_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` plus an optional property with a random name: a grammar no cache has seen."""
    return {**schema, "properties": {**schema["properties"], f"note_{secrets.token_hex(6)}": {"type": "string", "maxLength": 20}}}


def record(r: StreamResult) -> dict[str, Any]:
    """What --json keeps of one request."""
    return {
        "ttft_ms": None if r.ttft is None else r.ttft * 1000,
        "decode_tps": r.decode_tps,
        "output_tokens": r.tokens,
        "latency_ms": r.latency * 1000,
        "input_tokens": r.input_tokens,
        "cached_tokens": r.cached_tokens,
        "status": r.status,
        "error": r.error,
        "text": r.text,
    }


@dataclass
class Bench:
    """One server, one HTTP client: streams a prompt with or without a format."""

    base_url: str
    model: str
    client: httpx.AsyncClient
    timeout: float = 900.0

    async def stream(self, prompt: str, text_format: dict[str, Any] | None, max_tokens: int, temperature: float = 0.0) -> StreamResult:
        messages: list[Message] = [{"role": "user", "content": prompt}]
        result = await FormatAPI(self.base_url, self.model, text_format).stream(self.client, messages, max_tokens, temperature, self.timeout)
        if result.error:
            progress(f"request failed: {result.error[:300]}")
        return result


def _ms(values: list[float | None]) -> float | None:
    m = median(values)
    return None if m is None else m * 1000


async def decode_overhead(b: Bench, reps: int, max_tokens: int) -> dict[str, Any]:
    """Median decode tok/s with and without a schema, same prompt and token cap, interleaved."""
    fmt = json_format("story", DECODE_SCHEMA)
    await b.stream(DECODE_PROMPT, fmt, 8)  # compile and cache the grammar before measuring
    runs: dict[str, list[StreamResult]] = {"without": [], "with": []}
    for i in range(reps):
        order = ("without", "with") if i % 2 == 0 else ("with", "without")
        for kind in order:
            r = await b.stream(DECODE_PROMPT, fmt if kind == "with" else None, max_tokens)
            runs[kind].append(r)
            progress(f"decode {i + 1}/{reps} {kind:7} schema: {r.tokens} tokens, {r.decode_tps or 0:.1f} tok/s, status {r.status or r.error}")
    out: dict[str, Any] = {"max_output_tokens": max_tokens, "requests": reps}
    for kind, rs in runs.items():
        out[kind] = {
            "decode_tps": median([r.decode_tps for r in rs]),
            "ttft_ms": _ms([r.ttft for r in rs]),
            "min_tokens": min((r.tokens for r in rs if r.ok), default=0),
            "requests": [record(r) for r in rs],
        }
    w, wo = out["with"]["decode_tps"], out["without"]["decode_tps"]
    out["ratio"] = w / wo if w and wo else None
    out["short"] = [k for k in runs if out[k]["min_tokens"] < MIN_DECODE_TOKENS]
    return out


async def grammar_ttft(b: Bench, pairs: int, case: dict[str, Any]) -> dict[str, Any]:
    """TTFT: never-seen schema (cold compile) vs the same schema again (cached) vs no schema."""
    prompt = case["prompt"]
    await b.stream(prompt, None, TTFT_OUTPUT_TOKENS)  # caches the prompt's prefix
    await b.stream(prompt, json_format("warm", unique_schema(case["schema"])), TTFT_OUTPUT_TOKENS)  # first-use costs
    runs: dict[str, list[StreamResult]] = {"none": [], "cached": [], "cold": []}
    for i in range(pairs):
        fmt = json_format(case["name"], unique_schema(case["schema"]))
        cold = await b.stream(prompt, fmt, TTFT_OUTPUT_TOKENS)
        cached = await b.stream(prompt, fmt, TTFT_OUTPUT_TOKENS)
        none = await b.stream(prompt, None, TTFT_OUTPUT_TOKENS)
        for kind, r in (("cold", cold), ("cached", cached), ("none", none)):
            runs[kind].append(r)
        ms = lambda r: f"{(r.ttft or 0) * 1000:.0f} ms ({r.cached_tokens}/{r.input_tokens} prompt tokens cached)"  # noqa: E731
        progress(f"ttft {i + 1}/{pairs}: cold {ms(cold)}, cached {ms(cached)}, no schema {ms(none)}")
    out: dict[str, Any] = {"schema": case["name"], "pairs": pairs, "max_output_tokens": TTFT_OUTPUT_TOKENS}
    for kind, rs in runs.items():
        out[f"{kind}_ttft_ms"] = _ms([r.ttft for r in rs])
        out[f"{kind}_ttft_ms_min"] = min((r.ttft * 1000 for r in rs if r.ttft is not None), default=None)
    out["requests"] = {kind: [record(r) for r in rs] for kind, rs in runs.items()}
    c, k, n = out["cold_ttft_ms"], out["cached_ttft_ms"], out["none_ttft_ms"]
    out["cold_minus_cached_ms"] = c - k if c is not None and k is not None else None
    out["cached_minus_none_ms"] = k - n if k is not None and n is not None else None
    return out


def check_output(validator: jsonschema.Draft202012Validator, r: StreamResult) -> tuple[str, str | None]:
    """("valid"|"invalid"|"incomplete"|"error", why) for one sweep response."""
    if r.error:
        return "error", r.error[:300]
    if r.status == "incomplete":
        return "incomplete", None
    if r.status != "completed":
        return "error", f"status {r.status!r}"
    try:
        validator.validate(json.loads(r.text))
    except json.JSONDecodeError as exc:
        return "invalid", f"does not parse: {exc}"
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return "invalid", f"at {where}: {exc.message[:300]}"
    return "valid", None


async def sweep(b: Bench, cases: list[dict[str, Any]], n: int, concurrency: int) -> dict[str, dict[str, Any]]:
    """N samples per schema at temperature 1; a tally per schema, with every invalid output."""
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def one(case: dict[str, Any], validator: jsonschema.Draft202012Validator) -> tuple[str, str | None, StreamResult]:
        async with gate:
            r = await b.stream(case["prompt"], json_format(case["name"], case["schema"]), SWEEP_OUTPUT_TOKENS, 1.0)
        return (*check_output(validator, r), r)

    async def per_schema(case: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        nonlocal done
        validator = jsonschema.Draft202012Validator(case["schema"], format_checker=jsonschema.FormatChecker())
        results = await asyncio.gather(*(one(case, validator) for _ in range(n)))
        tally: dict[str, Any] = {k: 0 for k in ("valid", "invalid", "incomplete", "error")}
        tally["problems"] = []
        for verdict, why, r in results:
            tally[verdict] += 1
            if verdict in ("invalid", "error"):
                tally["problems"].append({"verdict": verdict, "why": why, "text": r.text, "status": r.status})
                progress(f"{verdict.upper()} {case['name']}: {why}; text {r.text[:200]!r}")
        tally["output_tokens_p50"] = median([float(r.tokens) for v, _, r in results if v == "valid"])
        done += 1
        progress(f"sweep {done}/{len(cases)} {case['name']}: {tally['valid']} valid, {tally['invalid']} invalid, {tally['incomplete']} incomplete, {tally['error']} error(s)")
        return case["name"], tally

    return dict(await asyncio.gather(*(per_schema(c) for c in cases)))


def unchecked_formats(cases: list[dict[str, Any]]) -> list[str]:
    """`format` values the schemas use that this jsonschema install cannot check (optional deps)."""
    used: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("format"), str):
                used.add(node["format"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for c in cases:
        walk(c["schema"])
    return sorted(used - set(jsonschema.FormatChecker().checkers))


def f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_decode(d: dict[str, Any]) -> None:
    print(f"\nDecode overhead: same prompt, {d['max_output_tokens']} output tokens, temperature 0, {d['requests']} requests each (medians)")
    print(f"{'':12}  {'decode tok/s':>12}  {'ttft ms':>8}  {'min tokens':>10}")
    for kind, label in (("without", "no schema"), ("with", "json_schema")):
        r = d[kind]
        print(f"{label:12}  {f(r['decode_tps']):>12}  {f(r['ttft_ms'], 0):>8}  {r['min_tokens']:>10}")
    if d["ratio"] is not None:
        cost = (1 - d["ratio"]) * 100
        print(f"with/without {d['ratio']:.3f}: the schema costs {cost:.1f}% of decode speed (target < 10%): {'OK' if cost < 10 else 'OVER TARGET'}")
    for kind in d["short"]:
        print(f"WARNING: a '{kind}' request produced fewer than {MIN_DECODE_TOKENS} tokens; its decode rate is not comparable")


def print_ttft(t: dict[str, Any]) -> None:
    print(f"\nGrammar compile: TTFT with schema {t['schema']!r}, same prompt (prefix cached), {t['max_output_tokens']} output tokens, {t['pairs']} pairs (medians)")
    print(f"{'':28}  {'ttft ms':>8}  {'min':>8}")
    for kind, label in (("none", "no schema"), ("cached", "schema, grammar cached"), ("cold", "schema never seen (cold)")):
        print(f"{label:28}  {f(t[f'{kind}_ttft_ms']):>8}  {f(t[f'{kind}_ttft_ms_min']):>8}")
    print(f"cold - cached: {f(t['cold_minus_cached_ms'])} ms (worker compile + first mask); cached - no schema: {f(t['cached_minus_none_ms'])} ms (medians)")


def print_sweep(results: dict[str, dict[str, Any]], n: int, unchecked: list[str]) -> None:
    print(f"\nSweep: {n} request(s) per schema, temperature 1.0, max_output_tokens {SWEEP_OUTPUT_TOKENS}")
    width = max(len(name) for name in [*results, "schema"])
    cols = ("valid", "invalid", "incomplete", "error")
    print(f"{'schema':{width}}  " + "  ".join(f"{c:>10}" for c in cols) + f"  {'tokens p50':>10}")
    for name, t in results.items():
        print(f"{name:{width}}  " + "  ".join(f"{t[c]:>10}" for c in cols) + f"  {f(t['output_tokens_p50'], 0):>10}")
    totals = {c: sum(t[c] for t in results.values()) for c in cols}
    print(f"{'total':{width}}  " + "  ".join(f"{totals[c]:>10}" for c in cols))
    for name, t in results.items():
        for p in t["problems"]:
            print(f"{p['verdict'].upper()} {name}: {p['why']}\n  output: {p['text'][:500]!r}")
    if unchecked:
        print(f"(formats not checked by this jsonschema install, missing optional packages: {', '.join(unchecked)})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=None, help="requests per kind for decode and TTFT pairs (default 6; --quick: 3)")
    p.add_argument("--quick", action="store_true", help="fewer requests: 3 of each kind")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens for the decode test (default %(default)s)")
    p.add_argument("--sweep", type=int, default=0, metavar="N", help="also sample every schema N times at temperature 1 (default: off; the issue's sweep is 10)")
    p.add_argument("--schemas", default=None, help="sweep only these: a count (the first K by name) or comma-separated names")
    p.add_argument("--concurrency", type=int, default=8, help="sweep requests in flight (default %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write every measurement here")
    p.add_argument("--blas-threads", type=int, default=None, help="OPENBLAS_NUM_THREADS for the worker")
    p.add_argument("--log-dir", type=Path, default=None, help="server log (default: a temp folder)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    opts = p.parse_args(argv)
    if opts.runs is None:
        opts.runs = 3 if opts.quick else 6
    return opts


def select(cases: list[dict[str, Any]], spec: str | None) -> list[dict[str, Any]]:
    if not spec:
        return cases
    if spec.isdigit():
        return cases[: int(spec)]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    by_name = {c["name"]: c for c in cases}
    missing = [n for n in names if n not in by_name]
    if missing:
        sys.exit(f"unknown schema(s) {', '.join(missing)}; see {SCHEMA_DIR}")
    return [by_name[n] for n in names]


async def run_all(server: Server, opts: argparse.Namespace, cases: list[dict[str, Any]], sweep_cases: list[dict[str, Any]]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=max(16, opts.concurrency), max_keepalive_connections=max(16, opts.concurrency))
    async with httpx.AsyncClient(limits=limits, timeout=900.0) as client:
        b = Bench(server.spec.base_url, server.spec.model, client)
        warm = await b.stream("Hello! Who are you?", None, 4)
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}; log {server.log_path}")
        out: dict[str, Any] = {}
        progress(f"decode overhead: {opts.runs} requests with and without a schema, {opts.max_tokens} tokens")
        out["decode"] = await decode_overhead(b, opts.runs, opts.max_tokens)
        progress(f"grammar compile: {opts.runs} cold/cached pairs")
        out["ttft"] = await grammar_ttft(b, opts.runs, next(c for c in cases if c["name"] == TTFT_SCHEMA_NAME))
        if opts.sweep:
            progress(f"sweep: {len(sweep_cases)} schemas x {opts.sweep}, {opts.concurrency} at once")
            started = time.perf_counter()
            out["sweep"] = await sweep(b, sweep_cases, opts.sweep, opts.concurrency)
            out["sweep_seconds"] = time.perf_counter() - started
        return out


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt  # unwinds through `with Server(...)`, which stops the server


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    opts = parse_args(argv)
    cases = load_cases()
    sweep_cases = select(cases, opts.schemas)
    spec = spec_for("kiln", blas_threads=opts.blas_threads)
    progress(f"starting kiln ({spec.note})")
    t0 = time.perf_counter()
    with Server(spec, log_dir=opts.log_dir, ready_timeout=opts.ready_timeout) as server:
        progress(f"ready in {time.perf_counter() - t0:.0f} s; log {server.log_path}")
        results = asyncio.run(run_all(server, opts, cases, sweep_cases))

    print(f"\nStructured output on {spec.model} ({spec.note})")
    print_decode(results["decode"])
    print_ttft(results["ttft"])
    status = 0
    unchecked: list[str] = []
    if "sweep" in results:
        unchecked = unchecked_formats(sweep_cases)
        print_sweep(results["sweep"], opts.sweep, unchecked)
        bad = sum(t["invalid"] + t["error"] for t in results["sweep"].values())
        if bad:
            print(f"\nFAIL: {bad} sweep response(s) invalid or failed (listed above)")
            status = 1
    if opts.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()}
        opts.json.write_text(json.dumps({"config": config, "server": spec.note, "unchecked_formats": unchecked, **results}, indent=2))
        print(f"\nwrote {opts.json}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
