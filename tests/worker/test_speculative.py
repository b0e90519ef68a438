"""Speculative decoding by prompt lookup: the index, the per-row cache repair, and the engine's
output with drafts, which must be exactly the output without them (greedy token for token, seeded
sampling draw for draw, stop tokens and length limits where they were)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from kiln.worker.engine import Scheduler
from kiln.worker.engine.rollback import drop_positions
from kiln.worker.engine.speculative import NgramIndex, RowDrafts, Speculation, choose_width

from .test_engine import Run, packed_tiny_llama, prompt_for, tiny_llama

ON, OFF = Speculation(mode="on"), Speculation(mode="off")


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    """Outputs are compared token for token on the tiny random models (see test_engine.py)."""
    monkeypatch.setenv("KILN_NATIVE_ACTIVATIONS", "float32")


# ---- the n-gram index ---------------------------------------------------------------------


def test_index_proposes_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3])
    # The suffix 1 2 3 occurred twice before; the latest one was followed by 5 6 7.
    assert index.propose(3) == ([5, 6, 7], 3)
    assert index.propose(10) == ([5, 6, 7, 1, 2, 3], 3)  # up to the end of what is known
    index.extend([5])
    assert index.propose(2) == ([6, 7], 4)  # 1 2 3 5 now matches four tokens


def test_index_prefers_the_longest_suffix_and_honours_min_match():
    index = NgramIndex([7, 8, 1, 8, 9, 8])
    assert index.propose(2) == ([], 0)  # no 2-gram ending the sequence occurred before
    index.extend([1])  # ... 8 1: occurred at the start, followed by 8 9
    assert index.propose(2) == ([8, 9], 2)
    assert index.propose(2, min_match=3) == ([], 0)
    assert NgramIndex([4, 4]).propose(3) == ([], 0)  # a single token never matches
    assert index.seen(2) and not index.seen(3)  # 8 1 occurred before; 9 8 1 did not
    assert NgramIndex([1, 2, 1, 2]).propose(0) == ([], 0)


def test_auto_drafts_as_far_as_the_rows_record_pays_for():
    auto = RowDrafts(Speculation(mode="auto", tokens=4), [1, 2, 3, 4, 1, 2, 3])
    assert auto.propose(10) == [4, 1, 2, 3]
    assert auto.propose(2) == [4, 1] and auto.propose(0) == []  # never past the row's budget
    assert RowDrafts(Speculation(mode="auto"), [5, 1, 2, 7, 1, 2]).propose(4) == []  # auto wants 3+ tokens
    assert RowDrafts(ON, [5, 1, 2, 7, 1, 2]).propose(4) == [7, 1, 2]  # on takes 2
    fresh = auto.acceptance
    for _ in range(6):
        auto.record(4, 4)
    assert auto.acceptance > 0.85
    assert choose_width([[4, 1, 2, 3]], [auto.acceptance]) == 5
    auto.record(4, 0)
    assert 1 < choose_width([[4, 1, 2, 3]], [auto.acceptance]) < 5  # fewer at once
    for _ in range(7):
        auto.record(4, 0)
    assert auto.acceptance < 0.3
    assert choose_width([[4, 1, 2, 3]], [auto.acceptance]) == 1  # a plain step: no drafts
    for _ in range(100):
        auto.record(0, 0)  # quiet steps: the record fades back to the prior, so it tries again
    assert auto.acceptance == pytest.approx(fresh, abs=0.02)
    assert choose_width([[4, 1, 2, 3]], [fresh]) > 1
    # One drafting row among eight: its drafts would widen every row's step; not worth it.
    assert choose_width([[4, 1, 2, 3]] + [[]] * 7, [0.9] + [fresh] * 7) == 1
    assert choose_width([[]], [fresh]) == 1


# ---- the cache repair ---------------------------------------------------------------------


@pytest.mark.parametrize("in_place", [False, True])
def test_dropping_different_counts_per_row_keeps_each_rows_kv(in_place):
    """Three left-padded rows, four new positions each; rows drop 3, 0 and 2 of them: each row's
    KV is then exactly its kept positions, and the next position appended lands right after."""
    lengths = [5, 3, 6]
    rows = [np.random.default_rng(i).standard_normal((1, 2, n + 4, 8)).astype(np.float32) for i, n in enumerate(lengths)]
    plain = []
    for r, n in zip(rows, lengths, strict=False):
        c = KVCache()
        c.update_and_fetch(mx.array(r[:, :, :n]), mx.array(r[:, :, :n] * 2))
        plain.append(c)
    cache = BatchKVCache.merge(plain)
    new = np.concatenate([r[:, :, -4:] for r in rows])
    cache.update_and_fetch(mx.array(new), mx.array(new * 2))
    mx.eval(cache.keys, cache.values)
    if in_place:  # as the native pass leaves them: evaluated, contiguous, writable
        cache.keys, cache.values = mx.array(np.array(cache.keys)), mx.array(np.array(cache.values))
    drop_positions([cache], [3, 0, 2], in_place=in_place)
    kept = [n + 4 - d for n, d in zip(lengths, [3, 0, 2], strict=False)]
    assert np.asarray(cache.offset).tolist() == kept
    for i, (r, n) in enumerate(zip(rows, kept, strict=False)):
        row = cache.extract(i)
        np.testing.assert_array_equal(np.array(row.keys), r[:, :, :n])
        np.testing.assert_array_equal(np.array(row.values), r[:, :, :n] * 2)


# ---- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["dense", "packed"])
def model(request):
    """Through mlx's forward pass (dense) and through the native whole-step pass (packed)."""
    return tiny_llama() if request.param == "dense" else packed_tiny_llama()


def run_all(model, speculation: Speculation, runs: list[Run], max_batch: int = 8, **kw) -> Scheduler:
    s = Scheduler(model, cache_bytes=0, max_batch=max_batch, speculation=speculation, **kw)
    s.start()
    try:
        for r in runs:
            r.submit(s)
        for r in runs:
            r.wait()
    finally:
        s.stop()
    return s


class Oracle:
    """Drafts from the future: each prompt's output as decoding without drafts gives it, spoiled
    from a given position on, so rows of one batch keep different numbers of drafts per step."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], spoil: dict[tuple[int, ...], int]):
        self.references = references
        self.spoil = spoil

    def install(self, monkeypatch) -> None:
        oracle = self

        def propose(drafts: RowDrafts, room: int) -> list[int]:
            known = drafts.index._tokens
            for prompt, ref in oracle.references.items():
                if tuple(known[: len(prompt)]) == prompt:
                    done = len(known) - len(prompt)  # output tokens already known
                    out = list(ref[done : done + min(4, room)])
                    cut = oracle.spoil[prompt]
                    return [t if done + j < cut else (t + 1) % 256 for j, t in enumerate(out)]
            return []

        monkeypatch.setattr(RowDrafts, "propose", propose)


def test_greedy_batch_with_rows_of_different_acceptance_equals_plain(model, monkeypatch):
    prompts = [prompt_for(i, 6 + 3 * i) for i in range(5)]
    plain = [Run(p, temperature=0, max_tokens=20) for p in prompts]
    run_all(model, OFF, plain)
    # Row 0 is drafted perfectly, row 1 never right, the others go wrong part way; row 4 has a
    # logprobs request riding along.
    spoil = {tuple(p): cut for p, cut in zip(prompts, [99, 0, 5, 11, 2], strict=False)}
    Oracle({tuple(p): r.tokens for p, r in zip(prompts, plain, strict=False)}, spoil).install(monkeypatch)
    drafted = [Run(p, temperature=0, max_tokens=20) for p in prompts]
    s = run_all(model, ON, drafted)
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    assert all(r.finish == "length" for r in drafted)
    stats = s.stats()
    assert stats["accepted_draft_tokens"] > 0 and stats["draft_tokens"] > stats["accepted_draft_tokens"]
    assert stats["decode_tokens"] > stats["decode_row_steps"]  # more than a token per row-step


def test_logprobs_per_delivered_token_as_without_drafts(model, monkeypatch):
    prompt = prompt_for(3, 9)
    plain = Run(prompt, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    run_all(model, OFF, [plain])
    Oracle({tuple(prompt): plain.tokens}, {tuple(prompt): 7}).install(monkeypatch)
    drafted = Run(prompt, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    run_all(model, ON, [drafted])
    assert drafted.tokens == plain.tokens
    for a, b in zip(drafted.steps, plain.steps, strict=False):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def test_stop_token_and_max_tokens_exact_under_drafts(model, monkeypatch):
    prompt = prompt_for(4, 8)
    plain = Run(prompt, temperature=0, max_tokens=16)
    run_all(model, OFF, [plain])
    Oracle({tuple(prompt): plain.tokens}, {tuple(prompt): 99}).install(monkeypatch)
    stop = plain.tokens[6]
    first = plain.tokens.index(stop)
    stopped = Run(prompt, stop=frozenset({stop}), temperature=0, max_tokens=16)
    short = Run(prompt, temperature=0, max_tokens=5)
    run_all(model, ON, [stopped])
    run_all(model, ON, [short])
    assert stopped.tokens == plain.tokens[: first + 1] and stopped.finish == "stop"
    assert short.tokens == plain.tokens[:5] and short.finish == "length"


def test_seeded_sampling_gives_the_same_tokens_and_distribution(model, monkeypatch):
    """Seeded requests draw the same tokens with drafts as without (so the distribution over many
    seeds is the same); the drafts here are the greedy path, which sampling keeps only in part."""
    prompt = prompt_for(5, 7)
    greedy = Run(prompt, temperature=0, max_tokens=6)
    run_all(model, OFF, [greedy])
    Oracle({tuple(prompt): greedy.tokens}, {tuple(prompt): 99}).install(monkeypatch)
    seeds = range(48)
    plain = [Run(prompt, temperature=1.0, seed=s, max_tokens=6) for s in seeds]
    drafted = [Run(prompt, temperature=1.0, seed=s, max_tokens=6) for s in seeds]
    run_all(model, OFF, plain)
    s = run_all(model, ON, drafted)
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    assert s.stats()["accepted_draft_tokens"] > 0
    # Total variation between the two empirical distributions of the first three tokens.
    count = lambda runs: {t: sum(1 for r in runs if tuple(r.tokens[:3]) == t) / len(runs) for t in {tuple(r.tokens[:3]) for r in runs}}  # noqa: E731
    p, q = count(plain), count(drafted)
    assert 0.5 * sum(abs(p.get(k, 0) - q.get(k, 0)) for k in set(p) | set(q)) == 0


def test_unseeded_sampling_keeps_the_distribution():
    """Rejection sampling with a point-mass draft: with a fixed next-token distribution, the first
    delivered token is distributed as the sampler's own draw, whatever the draft."""
    from kiln.worker.engine.batch import DecodeBatch, Row
    from kiln.worker.engine.sampling import RandomSampler

    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logprobs = np.log(np.tile(probs, (3, 1))).astype(np.float32)
    row = Row(1, None, RandomSampler(1.0, 1.0), tokens=[])  # type: ignore[arg-type]
    mx.random.seed(3)
    n = 4000
    firsts = [DecodeBatch._accept(row, logprobs, [1, 1])[0] for _ in range(n)]
    seen = np.bincount(firsts, minlength=4) / n
    assert 0.5 * np.abs(seen - probs).sum() < 0.03


def test_grammar_and_penalty_rows_beside_drafting_rows(model, monkeypatch):
    """A row with a logits processor never drafts and gets the tokens it gets without drafts; a
    penalized row drafts and its penalties still count every delivered token."""
    from kiln.worker.engine.batch import DecodeBatch

    def ban_odd(tokens, logits):
        return mx.where(mx.arange(logits.shape[-1]) % 2 == 1, -mx.inf, logits)

    prompts = [prompt_for(6, 8), prompt_for(7, 10), prompt_for(8, 9)]
    kinds = [dict(processors=[ban_odd]), dict(frequency_penalty=1.5, presence_penalty=0.5), {}]
    make = lambda: [Run(p, temperature=0, max_tokens=14, **k) for p, k in zip(prompts, kinds, strict=False)]  # noqa: E731
    plain = make()
    run_all(model, OFF, plain)
    Oracle({tuple(p): r.tokens for p, r in zip(prompts, plain, strict=False)}, {tuple(p): 99 for p in prompts}).install(monkeypatch)
    seen: list[bool] = []
    verify = DecodeBatch._verify

    def watch(self, drafts):
        seen.extend(bool(d) for d, r in zip(drafts, self.rows, strict=False) if r.context is not None)
        return verify(self, drafts)

    monkeypatch.setattr(DecodeBatch, "_verify", watch)
    drafted = make()
    s = run_all(model, ON, drafted)
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    assert all(t % 2 == 0 for t in drafted[0].tokens)
    assert seen and not any(seen)  # verification steps ran beside the grammar row, without its drafts
    assert s.stats()["accepted_draft_tokens"] > 0


def test_bundled_model_greedy_same_with_and_without_speculation(gguf_model, monkeypatch):
    """On the real model (native pass, default activations: 8-bit where the CPU has integer dot
    products), a prompt asking to repeat code: drafts from the prompt are accepted and the text is
    the same as without them."""
    monkeypatch.delenv("KILN_NATIVE_ACTIVATIONS")
    tok = gguf_model.tokenizer
    code = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    text = tok.apply_chat_template([{"role": "user", "content": f"Copy this code exactly:\n\n{code}"}], tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text)
    outs, stats = {}, {}
    for mode in ("off", "on", "auto"):
        run = Run(prompt, stop=frozenset(tok.eos_token_ids), temperature=0, max_tokens=48)
        # The stored weight layout: the session's model stays as other tests expect it.
        stats[mode] = run_all(gguf_model.model, Speculation(mode=mode), [run], input_major_weights=False).stats()
        outs[mode] = run.tokens
    assert outs["on"] == outs["off"] and outs["auto"] == outs["off"]
    assert "area" in tok.decode(outs["off"])
    for mode in ("on", "auto"):
        assert stats[mode]["accepted_draft_tokens"] > 0
        assert stats[mode]["decode_tokens"] > stats[mode]["decode_row_steps"]
