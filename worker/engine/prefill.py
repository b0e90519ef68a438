"""Prompt processing: pushing admitted requests' prompts through the model.

Why chunks: a long prompt prefilled in one forward pass would stall every decoding
request for its whole duration, so the scheduler interleaves one decode step with about
prefill_chunk prompt tokens. A long prompt prefills alone into a plain KVCache (no
padding waste), chunk by chunk, starting from whatever prefix the prefix cache holds.

Why short prompts go together: a forward pass over a few tokens costs about as much as
one over a single token (it is bound by reading the weights), so several short
remainders (new chats, or long conversations mostly served from the prefix cache) are
right-padded into one batched pass, as mlx-lm's PromptProcessingBatch does. Over longer
remainders the saving shrinks (the pass becomes bound by arithmetic), so groups are capped.

Either way the last prompt token is left for the decode batch, whose first step for the
row produces the first output token.

On the CPU, a group whose remainders are all the same length (one request alone, always) goes
through the native forward pass (native_decode.py) instead of mlx: with 8-bit activations and
integer dot products it did a 78-token prompt in ~0.6x the CPU time of mlx with OpenBLAS. Where
the native pass reads a GGUF's blocks, every group does, in runs of equal remainders: mlx's
padded pass would dequantize the blocks for BLAS (``_native_runs`` says what that cost).
A long prompt's chunks go through the native pass too where it reads a GGUF's blocks with its
GEMM or panel loops (``NativeDecoder.prefill_rows``; chunks of at most that many tokens, into a one-row batch
cache kept across chunks): mlx would dequantize the blocks piece by piece for BLAS, ~2x
llama-server's time to first token on a 1,000-token prompt. Elsewhere they go through mlx, whose
attention softmax and SiLU use cpu_exp.py's exp there.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from .cache import PrefixCache
from .native_decode import NativeDecoder
from .sampling import Sampler
from .types import EngineRequest

# Remainders up to SHORT_PREFILL tokens are prefilled together, in passes of at most
# GROUP_PREFILL tokens (rows x longest remainder). On the CPU a batched pass saves little over
# separate ones, so smaller groups get their first tokens out sooner: four 78-token prompts
# arriving together had a median time to first token of ~670 ms in groups of 256 tokens
# against ~960 ms in one pass of 512, in the same total time.
SHORT_PREFILL = 256
GROUP_PREFILL = 256


class Prefill:
    """Prefill state of one admitted request."""

    def __init__(self, handle: int, req: EngineRequest, chunk: int) -> None:
        self.handle = handle
        self.req = req
        self.chunk = max(1, chunk)
        self.cache: list[KVCache] | None = None
        self.pos = 0  # prompt positions already in self.cache
        self.cached = 0  # of which served by the prefix cache
        self.solo = False  # set after a batched pass containing it failed: retry alone
        self.sampler: Sampler | None = None  # made when it begins, so a bad one fails it alone
        # The native pass's one-row batch cache once a chunk went through it (then it, not
        # .cache, holds the prompt's KV: .cache keeps only what the prefix cache gave).
        self.native_cache: list[BatchKVCache] | None = None

    @property
    def begun(self) -> bool:
        return self.cache is not None

    def begin(self, model: nn.Module, prefix: PrefixCache | None) -> None:
        """Take the longest cached prefix (looked up now, not at submit, so it can use
        entries that requests ahead of it in the queue have just stored)."""
        cache, n = prefix.lookup(self.req.prompt, self.req.cache_scope) if prefix is not None else (None, 0)
        self.cache = cache if cache is not None else make_prompt_cache(model)
        self.pos = self.cached = n
        self.req.cached_tokens = n

    def begun_cache(self) -> list[KVCache]:
        """The cache begin() set up (every step after it reads this)."""
        assert self.cache is not None, "begin() comes first"
        return self.cache

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill (the last one is fed by the decode batch)."""
        return len(self.req.prompt) - 1 - self.pos

    @property
    def short(self) -> bool:
        """Whether the rest fits one pass that may be batched with other requests (not once the
        native pass holds the prompt's KV: its last chunk goes there too)."""
        return self.native_cache is None and self.remaining <= min(SHORT_PREFILL, self.chunk)

    def next_chunk(self) -> int:
        """Size of the next chunk; chunk boundaries depend only on this request."""
        return min(self.chunk, self.remaining)

    def run_chunk(self, model: nn.Module, native: NativeDecoder | None = None) -> int:
        """Push the next chunk through the model (KV only, no logits); tokens done. Through
        ``native`` where it takes long prompts' chunks (its prefill_rows)."""
        n = self.next_chunk()
        if native is not None and native.prefill_rows and (self.native_cache is not None or self.pos == self.cached):
            n = min(n, native.prefill_rows)
            if self.native_cache is None:
                self.native_cache = [c.merge([c]) for c in self.begun_cache()]
            native.prefill(np.array([self.req.prompt[self.pos : self.pos + n]], dtype=np.int32), self.native_cache)
            self.pos += n
            return n
        tokens = mx.array(self.req.prompt[self.pos : self.pos + n], dtype=mx.uint32)
        cache = self.begun_cache()
        model(tokens[None], cache=cache)  # logits stay lazy and are never computed
        mx.eval([c.state for c in cache])
        self.pos += n
        return n

    def batch_cache(self) -> list[BatchKVCache]:
        """This request's cache as a one-row batch cache, ready to join the decode batch."""
        if self.native_cache is not None:
            return self.native_cache
        return [c.merge([c]) for c in self.begun_cache()]


def prefill_together(model: nn.Module, group: list[Prefill], native: NativeDecoder | None = None) -> list[BatchKVCache]:
    """Finish the prefill of several requests in one right-padded pass (through ``native``
    where it takes them: remainders of one length, at most its max_rows tokens; and every group
    where it reads a GGUF's blocks, in runs of equal lengths: ``_native_runs``).

    Returns one batch cache per layer holding the group's rows in order (left-padded,
    as the decode batch expects). Each request's own cache is left untouched.
    """
    chunks = [p.req.prompt[p.pos : len(p.req.prompt) - 1] for p in group]
    lengths = [len(c) for c in chunks]
    width = max(lengths)
    padding = [width - n for n in lengths]
    if width > 0 and native is not None and native.prefill_rows and (max(padding) > 0 or len(chunks) * width > native.max_rows):
        return _native_runs(group, chunks, native)
    caches = _merged(group)
    if width == 0:
        return caches
    tokens = mx.array([c + [0] * (width - len(c)) for c in chunks], dtype=mx.uint32)
    if native is not None and max(padding) == 0 and len(chunks) * width <= native.max_rows:
        native.prefill(tokens, caches)
        _prefilled(group)
        return caches
    if max(padding) > 0:
        for c in caches:
            c.prepare(lengths=lengths, right_padding=padding)
    model(tokens, cache=caches)  # logits stay lazy and are never computed
    if max(padding) > 0:
        for c in caches:
            c.finalize()
    mx.eval([c.state for c in caches])
    _prefilled(group)
    return caches


def _merged(members: list[Prefill]) -> list[BatchKVCache]:
    """One batch cache per layer holding each member's begun cache (what the prefix cache gave
    it) as a row, left-padded to the longest."""
    return [c.merge(list(layer)) for c, layer in zip(members[0].begun_cache(), zip(*(p.begun_cache() for p in members), strict=False), strict=False)]


def _prefilled(group: list[Prefill]) -> None:
    """Mark the group's prompts done up to their last token, which the decode batch feeds."""
    for p in group:
        p.pos = len(p.req.prompt) - 1


def _native_runs(group: list[Prefill], chunks: list[list[int]], native: NativeDecoder) -> list[BatchKVCache]:
    """``prefill_together`` through the native pass for remainders of different lengths, or more
    tokens than one native step takes: each run of equal lengths in one pass (as many rows as
    ``prefill_rows`` tokens allow), the runs' caches then joined in the group's order.

    Why not mlx's padded pass: where the native pass reads a GGUF's blocks (``prefill_rows``),
    mlx dequantizes them piece by piece for BLAS. Eight 78-token prompts of slightly different
    token counts arriving together on a 1B Q4_0 file (the bench's 8 streams) spent 7.5 s in
    such a pass before their first tokens, against ~1 s through the native pass, and the
    8-stream aggregate of identical runs was 43 or 101 tokens/s depending on how the requests
    happened to be grouped."""
    runs: list[tuple[int, int]] = []  # (first row, rows) of equal remainders
    for i, chunk in enumerate(chunks):
        first, rows = runs[-1] if runs else (0, 0)
        if runs and len(chunks[first]) == len(chunk) and (rows + 1) * len(chunk) <= native.prefill_rows:
            runs[-1] = (first, rows + 1)
        else:
            runs.append((i, 1))
    joined: list[BatchKVCache] | None = None
    for first, rows in runs:
        members = group[first : first + rows]
        caches = _merged(members)
        if chunks[first]:
            native.prefill(np.array(chunks[first : first + rows], dtype=np.int32), caches)
        if joined is None:
            joined = caches
        else:
            for mine, theirs in zip(joined, caches, strict=True):
                mine.extend(theirs)
    assert joined is not None  # a group has a row
    _prefilled(group)
    return joined
