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

Speculation (speculative.py): when rows have drafts, the step instead feeds each row its last
token and its drafts as one (B, T) block, samples every position with the row's own sampler in
order and keeps drafts while the draw equals them; the first draw that differs is delivered in
place of the draft. Each delivered token is the sampler's draw from the right context, so the
output is the one a plain step would give (greedy token for token, a seeded sampler key for
key: its key splits once per delivered token). Rejected positions leave the cache
(rollback.py). Such a step waits for its inputs, so it does not pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, TokenBuffer

from .native_decode import NativeDecoder, log_softmax
from .rollback import drop_positions
from .sampling import Sampler, greedy, sample_rows, top_k_logprobs
from .speculative import DecodeStats, RowDrafts, Speculation, choose_width
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
    drafts: RowDrafts | None = None  # its prompt-lookup index, made on its first drafting step


@dataclass
class Delivery:
    """A token produced for a row at this token boundary."""

    row: Row
    token: int
    logprob: float
    top: list[tuple[int, float]] | None


# What _take reads back: each row's token, its logprob, and (when asked) its top ids and logprobs.
Taken = tuple[list[int], list[float], tuple[list[list[int]], list[list[float]]] | None]


def _pad_rows(x: mx.array, n: int) -> mx.array:
    """Append n placeholder rows to a pending per-row array."""
    return mx.concatenate([x, mx.zeros((n, *x.shape[1:]), dtype=x.dtype)])


def extract_row(cache: list[BatchKVCache], i: int) -> list[KVCache]:
    """A copy of row i's KV without its padding, as plain caches (copied in the background)."""
    out = [c.extract(i) for c in cache]
    mx.async_eval([(c.keys, c.values) for c in out])
    return out


class DecodeBatch:
    """Rows in generation, sharing one BatchKVCache per layer."""

    def __init__(
        self,
        model: nn.Module,
        native: NativeDecoder | None = None,
        speculation: Speculation | None = None,
        stats: DecodeStats | None = None,
    ) -> None:
        self.model = model
        # On the CPU, llama/Qwen models with packed weights decode outside mlx's graph.
        self.native = native
        self.speculation = speculation or Speculation(mode="off")
        self.stats = stats or DecodeStats()  # the scheduler's, outliving this batch
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
            inputs, logprobs = self._fed()
            for mine, theirs in zip(self._cache, cache, strict=False):
                mine.extend(theirs)
            self._inputs = mx.concatenate([inputs, tokens])
            self._logprobs = _pad_rows(logprobs, n)
            if self._top is not None:
                self._top = (_pad_rows(self._top[0], n), _pad_rows(self._top[1], n))
        for row in rows:
            if row.req.logits_processors:
                row.context = TokenBuffer(row.tokens)
        self.rows.extend(rows)

    def _fed(self) -> tuple[mx.array, mx.array]:
        """The tokens the next step feeds and their logprobs: set whenever the batch has rows."""
        assert self._inputs is not None and self._logprobs is not None, "an empty batch feeds nothing"
        return self._inputs, self._logprobs

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
        inputs, logprobs = self._fed()
        self._inputs = inputs[idx]
        self._logprobs = logprobs[idx]
        if self._top is not None:
            self._top = (self._top[0][idx], self._top[1][idx])

    def _apply_processors(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list[mx.array]]:
        """Run each row's logits processors on its own row; a failure marks only that row."""
        contexts: list[mx.array] = []
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
        """Advance every row by one token (or more, where drafts are accepted); return the
        tokens due for delivery."""
        drafts = self._drafts()
        out = self._verify(drafts) if drafts is not None else self._plain_step()
        self.stats.row_steps += len(self.rows)
        self.stats.tokens += len(out)
        return out

    def _plain_step(self) -> list[Delivery]:
        rows = self.rows
        inputs, fed_logprobs = self._fed()
        logprobs = None
        contexts: list[mx.array]
        decoder = self.native if self.native is not None and len(rows) <= self.native.max_rows else None
        native = decoder is not None
        if decoder is not None:
            found = decoder(inputs[:, None], self._cache)
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
        fed = self._take(inputs, fed_logprobs, self._top)
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
        for i, (row, sampler) in enumerate(zip(self.rows, samplers, strict=False)):
            try:
                picks.append(sampler(logprobs[i : i + 1]))
            except Exception as e:
                row.error = f"sampling failed: {e!r}"
                picks.append(greedy(logprobs[i : i + 1]))
        return mx.concatenate(picks)

    @staticmethod
    def _take(tokens: mx.array, logprobs: mx.array, top: tuple[mx.array, mx.array] | None) -> Taken:
        mx.eval(tokens, logprobs, top or ())
        return cast(Taken, (tokens.tolist(), logprobs.tolist(), (top[0].tolist(), top[1].tolist()) if top else None))

    @staticmethod
    def _delivery(row: Row, i: int, tokens: list[int], logprobs: list[float], top: tuple[list[list[int]], list[list[float]]] | None) -> Delivery:
        want = row.req.params.top_logprobs
        alts = None
        if want and top is not None:
            alts = sorted(zip(top[0][i], top[1][i], strict=False), key=lambda t: -t[1])[:want]
        return Delivery(row, tokens[i], logprobs[i], alts)

    # ---- speculation ---------------------------------------------------------------------

    def _drafts(self) -> list[list[int]] | None:
        """Each row's drafts for this step, or None for a plain step (no row drafts, or, in
        ``auto``, none that would pay for the wider step: see speculative.choose_width)."""
        if not self.speculation.enabled or not self.rows:
            return None
        eligible = []
        for row in self.rows:
            if row.context is None and row.error is None:  # a grammar's mask follows every token: no drafts
                if row.drafts is None:
                    row.drafts = RowDrafts(self.speculation, row.tokens)
                eligible.append(row)
        # On the pipelined path the pending tokens are still being computed: wait for them only
        # where a row's known tokens leave a match possible.
        if not eligible or (not self._fed_delivered and not any(r.drafts.may_match(r.tokens) for r in eligible if r.drafts)):
            self._quiet()
            return None
        pending = cast("list[int]", self._fed()[0].tolist())
        undelivered = 0 if self._fed_delivered else 1
        drafts: list[list[int]] = []
        for row, token in zip(self.rows, pending, strict=False):
            if row.drafts is None or row.context is not None or row.error is not None:
                drafts.append([])
                continue
            row.drafts.sync(row.tokens, token)
            # Tokens this row may still deliver: the pending one (if not out yet), the one this
            # step samples anyway, then drafts.
            room = row.req.params.max_tokens - row.generated - (undelivered if row.started else 0) - 1
            drafts.append(row.drafts.propose(room))
        if self.speculation.mode == "auto":
            width = choose_width(drafts, [r.drafts.acceptance if r.drafts else 0.0 for r in self.rows])
            drafts = [d[: width - 1] for d in drafts]
        if self.native is not None and self.native.kv_int8:
            # Only the native pass reads an 8-bit cache: the step must fit in one of its calls.
            drafts = [d[: self.native.max_rows // len(self.rows) - 1] for d in drafts]
        if not any(drafts):
            self._quiet()
            return None
        return drafts

    def _quiet(self) -> None:
        """A step without drafts: each row's record of past drafts fades a little."""
        for row in self.rows:
            if row.drafts is not None:
                row.drafts.record(0, 0)
        return None

    def _verify(self, drafts: list[list[int]]) -> list[Delivery]:
        """One step feeding each row its pending token and its drafts; deliver the kept drafts
        and the first draw that differs (or follows the last draft)."""
        rows = self.rows
        out: list[Delivery] = []
        inputs, fed_logprobs = self._fed()
        pending = self._take(inputs, fed_logprobs, self._top)
        if not self._fed_delivered:
            out.extend(self._delivery(row, i, *pending) for i, row in enumerate(rows) if row.started)
        last: list[int] = pending[0]
        width = 1 + max(len(d) for d in drafts)
        # Rows with fewer drafts are right-padded (with their own token): positions after a
        # row's real ones never reach its real positions' logits, and leave the cache below.
        block = mx.array([[t, *d] + [t] * (width - 1 - len(d)) for t, d in zip(last, drafts, strict=False)], dtype=mx.uint32)
        decoder = self.native if self.native is not None and len(rows) * width <= self.native.max_rows else None
        native = decoder is not None
        if decoder is not None:
            raw = decoder.forward(block, self._cache)
            logprobs = log_softmax(raw)
            first = mx.array(raw[:, 0, :]) if any(r.context is not None for r in rows) else None
        else:
            logits = self.model(block, cache=self._cache)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            mx.eval(logits, lp)
            logprobs = np.array(lp)
            first = logits[:, 0, :] if any(r.context is not None for r in rows) else None
        if first is not None:  # processor rows draft nothing: only their first position counts
            processed, _ = self._apply_processors(first, inputs)
            processed = processed - mx.logsumexp(processed, axis=-1, keepdims=True)
            processed_np = np.array(processed)
            for i, row in enumerate(rows):
                if row.context is not None:
                    logprobs[i, 0] = processed_np[i]

        rejected, nxt = [], []
        for i, row in enumerate(rows):
            d = drafts[i]
            picks = self._accept(row, logprobs[i, : len(d) + 1], d)
            kept = len(picks) - 1
            row.tokens.append(last[i])
            row.tokens.extend(d[:kept])
            rejected.append(width - 1 - kept)
            nxt.append(picks[-1])
            row.started = True
            if row.drafts is not None:
                row.drafts.record(len(d), kept)
            if d:
                self.stats.drafted += len(d)
                self.stats.accepted += kept
            if row.error is None:
                out.extend(self._scored(row, tok, logprobs[i, j]) for j, tok in enumerate(picks))
        drop_positions(self._cache, rejected, in_place=native)
        self._inputs = mx.array(nxt, dtype=mx.uint32)
        self._logprobs = mx.zeros((len(rows),))
        self._top = None
        self._fed_delivered = True
        self.steps += 1
        self.stats.verify_steps += 1
        return out

    @staticmethod
    def _accept(row: Row, logprobs: np.ndarray, drafts: list[int]) -> list[int]:
        """The row's draws at successive positions while they equal its drafts; the last one is
        the first that differs (or the one after the last draft). A sampler that raises marks
        the row (the scheduler ends it) and yields a placeholder that is never delivered."""
        if row.error is not None or row.sampler is greedy:
            best: list[int] = logprobs.argmax(axis=-1).tolist()
            kept = 0
            while kept < len(drafts) and best[kept] == drafts[kept]:
                kept += 1
            return best[: kept + 1]
        picks: list[int] = []
        try:
            for j in range(len(drafts) + 1):
                token = int(cast(int, row.sampler(mx.array(logprobs[j : j + 1])).item()))
                picks.append(token)
                if j == len(drafts) or token != drafts[j]:
                    break
        except Exception as e:
            row.error = f"sampling failed: {e!r}"
            return [int(logprobs[0].argmax())]
        return picks

    @staticmethod
    def _scored(row: Row, token: int, logprobs: np.ndarray) -> Delivery:
        """A delivered token with its logprob and the alternatives the request asked for."""
        want = row.req.params.top_logprobs
        alts = None
        if want:
            idx = np.argpartition(-logprobs, want - 1)[:want]
            alts = sorted(((int(t), float(logprobs[t])) for t in idx), key=lambda t: -t[1])
        return Delivery(row, token, float(logprobs[token]), alts)
