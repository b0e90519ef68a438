"""The running decode batch: one forward pass per token boundary for every active request.

Why our own class rather than mlx-lm's GenerationBatch: we need the chosen token's
logprob and the top-k alternatives computed inside the graph (one host transfer per
step instead of one per row), a logits processor failure confined to its own row, and
rows that join and leave between any two steps. The KV layout is mlx-lm's BatchKVCache
(left-padded rows, per-row offsets and masks), which also merges, filters and extracts
rows for us.

Pipelining (as mlx-lm's generate_step does): step() feeds the tokens sampled by the
previous step, queues the next forward pass with async_eval, and only then waits for the
previous step's results, so the host's bookkeeping overlaps the model's compute. The
native CPU decode step (native_decode.py) runs on the calling thread instead, so there is
nothing to overlap: its steps deliver the tokens they sample right away, a step earlier.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, TokenBuffer

from .native_decode import NativeDecoder, log_softmax
from .sampling import Sampler, greedy, sample_rows, top_k_logprobs
from .types import EngineRequest


@dataclass
class Row:
    """One request inside the decode batch."""

    handle: int
    req: EngineRequest
    sampler: Sampler
    tokens: list[int]  # every token whose KV is in the batch cache, in order
    context: TokenBuffer | None = None  # all tokens so far, for logits processors
    generated: int = 0
    started: bool = False  # its first step feeds the last prompt token: nothing to deliver
    error: str | None = None  # set when its logits processor failed


@dataclass
class Delivery:
    """A token produced for a row at this token boundary."""

    row: Row
    token: int
    logprob: float
    top: list[tuple[int, float]] | None


def _pad_rows(x: mx.array | None, n: int) -> mx.array | None:
    """Append n placeholder rows to a pending per-row array."""
    if x is None:
        return None
    return mx.concatenate([x, mx.zeros((n, *x.shape[1:]), dtype=x.dtype)])


def extract_row(cache: list[BatchKVCache], i: int) -> list[KVCache]:
    """A copy of row i's KV without its padding, as plain caches (copied in the background)."""
    out = [c.extract(i) for c in cache]
    mx.async_eval([(c.keys, c.values) for c in out])
    return out


class DecodeBatch:
    """Rows in generation, sharing one BatchKVCache per layer."""

    def __init__(self, model: nn.Module, native: NativeDecoder | None = None) -> None:
        self.model = model
        # On the CPU, llama/Qwen models with packed weights decode outside mlx's graph.
        self.native = native
        self.rows: list[Row] = []
        self._cache: list[BatchKVCache] = []
        self._inputs: mx.array | None = None  # (B,) tokens the next step feeds
        self._logprobs: mx.array | None = None  # (B,) their logprobs
        self._top: tuple[mx.array, mx.array] | None = None  # (B, k) ids and logprobs
        self._fed_delivered = False  # whether _inputs went out when they were sampled
        self.steps = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list[Row], cache: list[BatchKVCache], last_tokens: list[int]) -> None:
        """Join prefilled requests: cache holds their prompts minus the last token."""
        tokens = mx.array(last_tokens, dtype=mx.uint32)
        n = len(rows)
        if not self.rows:
            self._cache = cache
            self._inputs = tokens
            self._logprobs = mx.zeros((n,))
            self._top = None
        else:
            for mine, theirs in zip(self._cache, cache):
                mine.extend(theirs)
            self._inputs = mx.concatenate([self._inputs, tokens])
            self._logprobs = _pad_rows(self._logprobs, n)
            if self._top is not None:
                self._top = (_pad_rows(self._top[0], n), _pad_rows(self._top[1], n))
        for row in rows:
            if row.req.logits_processors:
                row.context = TokenBuffer(row.tokens)
        self.rows.extend(rows)

    def extract(self, i: int) -> list[KVCache]:
        """Row i's KV (exactly the positions of rows[i].tokens), as plain caches."""
        return extract_row(self._cache, i)

    def remove(self, drop: set[int]) -> None:
        """Take rows (by index) out of the batch; the in-flight step is filtered too."""
        keep = [i for i in range(len(self.rows)) if i not in drop]
        if not keep:
            self.rows = []
            self._cache = []
            self._inputs = self._logprobs = self._top = None
            return
        self.rows = [self.rows[i] for i in keep]
        for c in self._cache:
            c.filter(keep)
        idx = mx.array(keep)
        self._inputs = self._inputs[idx]
        self._logprobs = self._logprobs[idx]
        if self._top is not None:
            self._top = (self._top[0][idx], self._top[1][idx])

    def _apply_processors(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list]:
        """Run each row's logits processors on its own row; a failure marks only that row."""
        contexts = []
        if not any(r.context is not None for r in self.rows):
            return logits, contexts
        out = []
        for i, row in enumerate(self.rows):
            row_logits = logits[i : i + 1]
            if row.context is not None and row.error is None:
                context = row.context.update_and_fetch(inputs[i : i + 1])
                contexts.append(context)
                try:
                    processed = row_logits
                    for processor in row.req.logits_processors:
                        processed = processor(context, processed)
                    if processed.shape != row_logits.shape:
                        raise ValueError(f"returned shape {processed.shape}")
                    row_logits = processed.astype(logits.dtype)
                except Exception as e:  # confine a bad grammar to its own request
                    row.error = f"logits processor failed: {e!r}"
            out.append(row_logits)
        return mx.concatenate(out), contexts

    def step(self) -> list[Delivery]:
        """Advance every row by one token; return the tokens due for delivery."""
        rows = self.rows
        inputs = self._inputs
        logprobs = None
        native = self.native is not None and len(rows) <= self.native.max_rows
        if native:
            found = self.native(inputs[:, None], self._cache)
            if all(r.context is None for r in rows):
                # mlx's CPU exp is slow; numpy's log-softmax over the vocabulary is not.
                logprobs, contexts = mx.array(log_softmax(found)), []
            else:
                logits = mx.array(found)
        else:
            logits = self.model(inputs[:, None], cache=self._cache)[:, -1, :]
        if logprobs is None:
            logits, contexts = self._apply_processors(logits, inputs)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nxt = self._sample(logprobs)
        nxt_lp = mx.take_along_axis(logprobs, nxt[:, None], axis=-1)[:, 0]
        k = max(r.req.params.top_logprobs for r in rows)
        nxt_top = top_k_logprobs(logprobs, k) if k else None
        mx.async_eval(nxt, nxt_lp, nxt_top or (), contexts)

        # The tokens fed by this step are now in the cache; unless they went out when they
        # were sampled, deliver them.
        fed = self._take(inputs, self._logprobs, self._top)
        out = []
        for i, row in enumerate(rows):
            row.tokens.append(fed[0][i])
            if not row.started:
                row.started = True
            elif not self._fed_delivered:
                out.append(self._delivery(row, i, *fed))
        self._inputs, self._logprobs, self._top = nxt, nxt_lp, nxt_top
        self.steps += 1
        self._fed_delivered = native
        if native:
            # The forward pass ran on this thread, so waiting for the sampled tokens now costs
            # nothing, and delivering them a step early takes one step off every token's latency.
            sampled = self._take(nxt, nxt_lp, nxt_top)
            out.extend(self._delivery(row, i, *sampled) for i, row in enumerate(rows) if row.error is None)
        return out

    def _sample(self, logprobs: mx.array) -> mx.array:
        """One token per row. A sampler that raises fails only its own row: the row is marked
        (the scheduler ends it) and takes the argmax as a placeholder that is never delivered."""
        samplers = [r.sampler if r.error is None else greedy for r in self.rows]
        try:
            return sample_rows(logprobs, samplers)
        except Exception:
            pass
        picks = []
        for i, (row, sampler) in enumerate(zip(self.rows, samplers)):
            try:
                picks.append(sampler(logprobs[i : i + 1]))
            except Exception as e:
                row.error = f"sampling failed: {e!r}"
                picks.append(greedy(logprobs[i : i + 1]))
        return mx.concatenate(picks)

    @staticmethod
    def _take(tokens: mx.array, logprobs: mx.array, top: tuple[mx.array, mx.array] | None) -> tuple:
        mx.eval(tokens, logprobs, top or ())
        return tokens.tolist(), logprobs.tolist(), (top[0].tolist(), top[1].tolist()) if top else None

    @staticmethod
    def _delivery(row: Row, i: int, tokens: list[int], logprobs: list[float], top: tuple | None) -> Delivery:
        want = row.req.params.top_logprobs
        alts = None
        if want and top is not None:
            alts = sorted(zip(top[0][i], top[1][i]), key=lambda t: -t[1])[:want]
        return Delivery(row, tokens[i], logprobs[i], alts)
