"""The workloads: each runs against one started server and returns flat metrics for one run.

  single         one stream at a time: 48-token prompt, 64 output tokens, temperature 0
  concurrent     1, 4 and 8 streams started together (distinct prompts of the same length)
  conversation   a 5-turn conversation resending the whole history each turn; turn-5 TTFT
                 against the same-size prompt sent cold, and the server's cached_tokens
  shared_system  requests sharing a ~1k-token system prompt: the first (cold) against the rest
  long_prompt    one ~1,000-token prompt, cold: TTFT is prompt processing at that length
  agent_edit     an agent's edit turn: a ~600-token source file and "rewrite it with one change",
                 so the answer copies most of the prompt (where speculative decoding pays); not in
                 the default set (--workloads agent_edit; bench/speculative.py runs it)

Metric names are "<workload>.<metric>"; units are in the name (_ms, _tps, _tokens).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from . import prompts
from .client import _API, StreamResult, median, percentile

WORKLOADS = ("single", "concurrent", "conversation", "shared_system")
# `--model-shape` runs (1B-8B models on a CPU): the four figures, in minutes per run.
SHAPE_WORKLOADS = ("single", "concurrent", "long_prompt")


@dataclass
class Config:
    single_reps: int = 3
    prompt_tokens: int = 48
    output_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 4, 8)
    turns: int = 5
    turn_output_tokens: int = 32
    system_tokens: int = 1000
    system_requests: int = 4
    system_output_tokens: int = 16
    edit_reps: int = 2
    edit_tokens: int = 600
    edit_output_tokens: int = 256
    long_prompt_tokens: int = 1000
    long_output_tokens: int = 8
    timeout: float = 900.0

    @classmethod
    def quick(cls) -> Config:
        return cls(single_reps=1, output_tokens=32, concurrency=(1, 4), turns=3, turn_output_tokens=16, system_tokens=256, system_requests=2, system_output_tokens=8, edit_reps=1,
            edit_output_tokens=128, long_prompt_tokens=256)

    @classmethod
    def model_shape(cls, quick: bool = False) -> Config:
        """For 1B-8B models at a few tokens a second: one stream (64 tokens, 3 requests; the
        median), 8 streams together, and one 1,000-token prompt. `quick`: 32 tokens, 1 request,
        a 256-token long prompt."""
        if quick:
            return cls(single_reps=1, output_tokens=32, concurrency=(8,), long_prompt_tokens=256)
        return cls(concurrency=(8,))


@dataclass
class Context:
    api: _API
    client: httpx.AsyncClient
    cfg: Config
    run: int
    progress: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)
    errors: list[str] = field(default_factory=list)
    texts: dict[str, list[str]] = field(default_factory=dict)  # each workload's answers, in order

    async def stream(self, messages, max_tokens, exact: bool = False) -> StreamResult:
        """One request at temperature 0; `exact` asks for max_tokens where the server can promise it."""
        result = await self.api.stream(self.client, messages, max_tokens, 0.0, self.cfg.timeout, exact=exact)
        if result.error:
            self.errors.append(result.error)
        return result


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _describe(r: StreamResult) -> str:
    if r.error:
        return f"ERROR {r.error[:120]}"
    tps = r.decode_tps
    return f"ttft {r.ttft * 1000:.0f} ms, {r.tokens} tok, {tps:.1f} tok/s" if tps else f"ttft {r.ttft * 1000:.0f} ms, {r.tokens} tok"


async def single(ctx: Context) -> dict[str, float | None]:
    results = []
    for i in range(ctx.cfg.single_reps):
        msgs = [{"role": "user", "content": prompts.user_prompt(ctx.run, 100 + i, ctx.cfg.prompt_tokens)}]
        r = await ctx.stream(msgs, ctx.cfg.output_tokens, exact=True)
        ctx.progress(f"    single {i + 1}/{ctx.cfg.single_reps}: {_describe(r)}")
        results.append(r)
    ctx.texts["single"] = [r.text for r in results]
    ok = [r for r in results if r.ok]
    lat = [r.latency * 1000 for r in ok]
    return {
        "single.ttft_ms": median([_ms(r.ttft) for r in ok]),
        "single.decode_tps": median([r.decode_tps for r in ok]),
        "single.latency_p50_ms": percentile(lat, 50),
        "single.output_tokens": median([r.tokens for r in ok]),
        "single.input_tokens": median([r.input_tokens for r in ok]),
    }


async def concurrent(ctx: Context) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for c in ctx.cfg.concurrency:
        msgs = [[{"role": "user", "content": prompts.user_prompt(ctx.run, 200 + 10 * c + i, ctx.cfg.prompt_tokens)}] for i in range(c)]
        results = await asyncio.gather(*(ctx.stream(m, ctx.cfg.output_tokens, exact=True) for m in msgs))
        ok = [r for r in results if r.ok]
        key = f"conc{c}"
        if ok:
            wall = max(r.end for r in ok) - min(r.start for r in ok)
            agg = sum(r.tokens for r in ok) / wall if wall > 0 else None
            lat = [r.latency * 1000 for r in ok]
            out.update({
                f"{key}.ttft_p50_ms": percentile([_ms(r.ttft) for r in ok], 50),
                f"{key}.decode_tps_p50": median([r.decode_tps for r in ok]),
                f"{key}.aggregate_tps": agg,
                f"{key}.latency_p50_ms": percentile(lat, 50),
                f"{key}.latency_p99_ms": percentile(lat, 99),
                f"{key}.output_tokens": sum(r.tokens for r in ok),  # all streams: what aggregate_tps counts
            })
            ctx.progress(f"    {c} concurrent: {len(ok)}/{c} ok, aggregate {agg or 0:.1f} tok/s, p50 latency {percentile(lat, 50):.0f} ms")
        else:
            ctx.progress(f"    {c} concurrent: all {c} failed ({results[0].error})")
    return out


async def conversation(ctx: Context) -> dict[str, float | None]:
    turns = ctx.cfg.turns
    history: list[dict[str, str]] = []
    last: StreamResult | None = None
    for t in range(turns):
        question = prompts.QUESTIONS[t % len(prompts.QUESTIONS)]
        content = prompts.user_prompt(ctx.run, 300, ctx.cfg.prompt_tokens, question) if t == 0 else question
        history.append({"role": "user", "content": content})
        last = await ctx.stream(list(history), ctx.cfg.turn_output_tokens)
        ctx.progress(f"    conversation turn {t + 1}/{turns}: {_describe(last)}, cached {last.cached_tokens}")
        if not last.ok:
            return {}
        history.append({"role": "assistant", "content": last.text})
    # The same turn-N prompt, cold: only the tag of the first user message differs.
    cold_msgs = [dict(m) for m in history[:-1]]
    cold_msgs[0]["content"] = cold_msgs[0]["content"].replace(prompts.tag("u", ctx.run, 300), prompts.tag("u", ctx.run, 399), 1)
    cold = await ctx.stream(cold_msgs, ctx.cfg.turn_output_tokens)
    ctx.progress(f"    conversation turn-{turns} prompt cold: {_describe(cold)}, cached {cold.cached_tokens}")
    assert last is not None
    warm_ttft, cold_ttft = _ms(last.ttft), _ms(cold.ttft) if cold.ok else None
    return {
        "conversation.last_turn_ttft_ms": warm_ttft,
        "conversation.cold_ttft_ms": cold_ttft,
        "conversation.warm_over_cold": (warm_ttft / cold_ttft) if warm_ttft and cold_ttft else None,
        "conversation.last_turn_input_tokens": last.input_tokens,
        "conversation.last_turn_cached_tokens": last.cached_tokens,
    }


async def shared_system(ctx: Context) -> dict[str, float | None]:
    system = prompts.system_prompt(ctx.run, ctx.cfg.system_tokens)
    results = []
    for i in range(ctx.cfg.system_requests):
        question = prompts.QUESTIONS[(i + 1) % len(prompts.QUESTIONS)]
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": prompts.tag("q", ctx.run, i) + question}]
        r = await ctx.stream(msgs, ctx.cfg.system_output_tokens)
        ctx.progress(f"    shared system prompt {i + 1}/{ctx.cfg.system_requests}: {_describe(r)}, input {r.input_tokens}, cached {r.cached_tokens}")
        results.append(r)
    cold, warm = results[0], [r for r in results[1:] if r.ok]
    cold_ms = _ms(cold.ttft) if cold.ok else None
    warm_ms = median([_ms(r.ttft) for r in warm])
    return {
        "shared_system.cold_ttft_ms": cold_ms,
        "shared_system.warm_ttft_ms": warm_ms,
        "shared_system.warm_over_cold": (warm_ms / cold_ms) if warm_ms and cold_ms else None,
        "shared_system.input_tokens": cold.input_tokens,
        "shared_system.warm_cached_tokens": median([r.cached_tokens for r in warm]),
    }


async def long_prompt(ctx: Context) -> dict[str, float | None]:
    msgs = [{"role": "user", "content": prompts.user_prompt(ctx.run, 600, ctx.cfg.long_prompt_tokens)}]
    r = await ctx.stream(msgs, ctx.cfg.long_output_tokens)
    ctx.progress(f"    long prompt: {_describe(r)}, input {r.input_tokens}")
    return {
        "long_prompt.ttft_ms": _ms(r.ttft) if r.ok else None,
        "long_prompt.input_tokens": r.input_tokens,
    }


async def agent_edit(ctx: Context) -> dict[str, float | None]:
    results = []
    for i in range(ctx.cfg.edit_reps):
        msgs = [{"role": "user", "content": prompts.edit_prompt(ctx.run, 500 + i, ctx.cfg.edit_tokens)}]
        r = await ctx.stream(msgs, ctx.cfg.edit_output_tokens)
        ctx.progress(f"    agent edit {i + 1}/{ctx.cfg.edit_reps}: {_describe(r)}, input {r.input_tokens}")
        results.append(r)
    ctx.texts["agent_edit"] = [r.text for r in results]
    ok = [r for r in results if r.ok]
    return {
        "agent_edit.ttft_ms": median([_ms(r.ttft) for r in ok]),
        "agent_edit.decode_tps": median([r.decode_tps for r in ok]),
        "agent_edit.output_tokens": median([r.tokens for r in ok]),
        "agent_edit.input_tokens": median([r.input_tokens for r in ok]),
    }


RUNNERS: dict[str, Callable[[Context], Awaitable[dict[str, float | None]]]] = {
    "single": single,
    "concurrent": concurrent,
    "conversation": conversation,
    "shared_system": shared_system,
    "long_prompt": long_prompt,
    "agent_edit": agent_edit,
}

# Whether a larger value is better, by metric suffix (for reading ratios).
HIGHER_IS_BETTER = ("_tps", "_tps_p50", "aggregate_tps", "cached_tokens")


def higher_is_better(metric: str) -> bool | None:
    if metric.endswith(("input_tokens", "output_tokens")):
        return None
    return metric.endswith(HIGHER_IS_BETTER)
