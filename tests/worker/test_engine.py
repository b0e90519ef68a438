"""The engine's scheduler on a tiny random llama: batching, sampling, caching, failures.

The model is random but seeded and its weights scaled up so greedy output wanders over
the vocabulary: any mix-up of rows, positions or cache entries changes the tokens.
Greedy references come from mlx-lm's own single-sequence generate_step.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.sample_utils import greedy_sampler

from kiln.worker.engine import EngineRequest, QueueFull, SamplingParams, Scheduler, Step
from kiln.worker.engine.cache import PrefixCache
from kiln.worker.engine.layout import choose_weight_layout
from kiln.worker.engine.native_decode import NativeDecoder
from kiln.worker.loading.device import cast_floating, dequantize_modules
from kiln.worker.native.build import cpu_kernels

VOCAB = 256


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    """These tests compare the scheduler's output with mlx-lm's token for token, so the native
    decode step keeps float32 activations: 8-bit ones may flip a near tie of these flat random
    models (tests/worker/test_native.py checks them against mlx's forward pass instead)."""
    monkeypatch.setenv("KILN_NATIVE_ACTIVATIONS", "float32")


def tiny_llama():
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    m = llama.Model(args)
    m.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, m.parameters()))
    mx.eval(m.parameters())
    return m


def packed_tiny_llama():
    """The tiny llama quantized to 4 bits, then prepared as "auto" prepares it on the CPU:
    float32 layers for prefill that decode through the native kernel (and, being a llama,
    through the native decode step)."""
    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("no C compiler for the native CPU kernels")
    m = tiny_llama()
    nn.quantize(m, group_size=32, bits=4)
    cast_floating(m, mx.float16)  # scales as checkpoints store them
    dequantize_modules(m, mx.float32, kernel)
    mx.eval(m.parameters())
    assert NativeDecoder.build(m) is not None  # checked against mlx's forward inside
    return m


def tiny_qwen(version: int):
    """A tiny Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms), packed like the llama above."""
    from mlx_lm.models import qwen2, qwen3

    common = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)  # fmt: skip
    mx.random.seed(version)
    if version == 2:
        m = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **common))
    else:
        m = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", head_dim=16, **common))
    m.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p + 0.1 * mx.random.normal(p.shape), m.parameters()))
    nn.quantize(m, group_size=32, bits=4)
    cast_floating(m, mx.float16)
    dequantize_modules(m, mx.float32, cpu_kernels())
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("version", [2, 3])
def test_qwen_models_decode_natively_like_mlx_lm(version):
    if cpu_kernels() is None:
        pytest.skip("no C compiler for the native CPU kernels")
    m = tiny_qwen(version)
    assert NativeDecoder.build(m) is not None  # matched mlx's forward pass
    s = Scheduler(m, cache_bytes=0, max_batch=4)
    s.start()
    try:
        prompts = [prompt_for(i, 7 + 5 * i) for i in range(3)]
        runs = [Run(p, temperature=0, max_tokens=12).submit(s) for p in prompts]
        for p, r in zip(prompts, runs):
            assert r.wait().tokens == reference(m, p, 12)
        assert s._batch.native is not None
    finally:
        s.stop()


@pytest.fixture(scope="module", params=["dense", "packed"])
def model(request):
    """Every scheduler test runs on plain float32 weights and on packed ones."""
    return tiny_llama() if request.param == "dense" else packed_tiny_llama()


@pytest.fixture
def make_scheduler(model):
    made = []

    def make(**kw) -> Scheduler:
        s = Scheduler(model, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


class Run:
    """Collects one request's steps."""

    def __init__(self, prompt: list[int], stop: frozenset[int] = frozenset(), processors=(), **params):
        self.steps: list[Step] = []
        self.done = threading.Event()
        self.first = threading.Event()
        self.req = EngineRequest(
            prompt=list(prompt),
            params=SamplingParams(**params),
            stop_tokens=stop,
            on_step=self._on_step,
            logits_processors=list(processors),
        )
        self.cached_at_first_step: int | None = None

    def _on_step(self, step: Step) -> None:
        if not self.steps:
            self.cached_at_first_step = self.req.cached_tokens
            self.first.set()
        self.steps.append(step)
        if step.finish_reason is not None:
            self.done.set()

    def submit(self, s: Scheduler) -> "Run":
        self.handle = s.submit(self.req)
        return self

    def wait(self, timeout: float = 60) -> "Run":
        assert self.done.wait(timeout), "request did not finish"
        return self

    @property
    def tokens(self) -> list[int]:
        return [st.token for st in self.steps if st.token is not None]

    @property
    def finish(self) -> str | None:
        return self.steps[-1].finish_reason if self.steps else None


def prompt_for(i: int, n: int) -> list[int]:
    return [(7 * j + 13 * i + 1) % VOCAB for j in range(n)]


def reference(model, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=greedy_sampler)
    return [int(t) for t, _ in steps]


def kept_output(s: Scheduler, output: list[int]) -> int:
    """How many of a finished request's output tokens have their KV in the prefix cache: all
    when tokens are delivered a step after being sampled (the last one was fed), all but the
    last when the native CPU step delivers each token as soon as it is sampled."""
    return len(output) - (1 if s._batch.native is not None else 0)


def greedy(s: Scheduler, prompt: list[int], n: int, **kw) -> Run:
    return Run(prompt, temperature=0, max_tokens=n, **kw).submit(s).wait()


def test_greedy_matches_mlx_lm(model, make_scheduler):
    s = make_scheduler()
    s.start()
    prompt = prompt_for(0, 23)
    run = greedy(s, prompt, 16)
    assert run.tokens == reference(model, prompt, 16)
    assert run.finish == "length"
    assert [st.finish_reason for st in run.steps[:-1]] == [None] * 15
    assert s.stats()["active"] == 0


@pytest.mark.parametrize("input_major", [False, True])
def test_both_weight_layouts_decode_like_mlx_lm(input_major):
    fresh = tiny_llama()
    prompt = prompt_for(3, 19)
    expected = reference(fresh, prompt, 12)
    s = Scheduler(fresh, input_major_weights=input_major)
    s.start()
    try:
        assert greedy(s, prompt, 12).tokens == expected
    finally:
        s.stop()


def test_measured_layout_choice_keeps_the_model_function():
    fresh = tiny_llama()
    probe = mx.array([prompt_for(1, 9)])
    before = fresh(probe)
    assert choose_weight_layout(fresh, steps=2, rounds=1) in (True, False)
    assert mx.allclose(fresh(probe), before, rtol=1e-4, atol=1e-4).item()


def test_batch_of_8_equals_alone(model, make_scheduler):
    """Different prompt lengths force left padding; every row must match its solo run."""
    prompts = [prompt_for(i, 5 + 9 * i) for i in range(8)]
    alone = make_scheduler(cache_bytes=0)
    alone.start()
    solo = [greedy(alone, p, 20).tokens for p in prompts]
    batched = make_scheduler(cache_bytes=0, max_batch=8)
    runs = [Run(p, temperature=0, max_tokens=20).submit(batched) for p in prompts]
    batched.start()  # all eight are queued before the first step: one batch
    together = [r.wait().tokens for r in runs]
    assert together == solo
    assert solo[3] == reference(model, prompts[3], 20)


def test_batch_shrinking_past_the_native_row_limit(model, make_scheduler):
    """Twelve rows decode through mlx's graph (tokens delivered a step after sampling); as
    they finish, the packed model's batch drops to the native step's eight rows (delivered as
    sampled). No token may be lost or repeated at the switch, and stop tokens still end rows."""
    prompts = [prompt_for(i, 6 + i) for i in range(12)]
    s = make_scheduler(cache_bytes=0, max_batch=12)
    runs = [Run(p, temperature=0, max_tokens=4 + 3 * i).submit(s) for i, p in enumerate(prompts)]
    s.start()
    for i, (p, r) in enumerate(zip(prompts, runs)):
        assert r.wait().tokens == reference(model, p, 4 + 3 * i)
        assert [st.finish_reason for st in r.steps] == [None] * (3 + 3 * i) + ["length"]


def test_requests_join_and_leave_a_running_batch(model, make_scheduler):
    s = make_scheduler(cache_bytes=0, max_batch=4)
    s.start()
    long = Run(prompt_for(1, 30), temperature=0, max_tokens=60).submit(s)
    assert long.first.wait(30)
    short = [Run(prompt_for(i, 4 + i), temperature=0, max_tokens=3 + 2 * i).submit(s) for i in range(2, 8)]
    for r in short:
        r.wait()
    long.wait()
    assert len(long.steps) == 60  # still running while the others came and went
    assert long.tokens == reference(model, prompt_for(1, 30), 60)
    for i, r in zip(range(2, 8), short):
        assert r.tokens == reference(model, prompt_for(i, 4 + i), 3 + 2 * i)


def test_stop_token_ends_with_stop(model, make_scheduler):
    s = make_scheduler()
    s.start()
    prompt = prompt_for(2, 12)
    ref = reference(model, prompt, 12)
    stop = ref[5]
    run = greedy(s, prompt, 12, stop=frozenset({stop}))
    assert run.finish == "stop"
    assert run.tokens == ref[: ref.index(stop) + 1]  # the stop token is the last step's token


def test_chunked_prefill_same_output_and_does_not_stall_decoding(model, make_scheduler):
    prompt = prompt_for(3, 300)
    whole = make_scheduler(cache_bytes=0, prefill_chunk=4096)
    whole.start()
    expected = greedy(whole, prompt, 8).tokens

    s = make_scheduler(cache_bytes=0, prefill_chunk=8)
    s.start()
    decoding = Run(prompt_for(4, 6), temperature=0, max_tokens=25).submit(s)
    assert decoding.first.wait(30)
    long = Run(prompt, temperature=0, max_tokens=8).submit(s)
    decoding.wait()
    # 300 prompt tokens in chunks of 8 take ~37 turns; the short request needed 25.
    assert not long.first.is_set()
    assert long.wait().tokens == expected


def test_long_prefill_reports_progress_per_chunk_before_its_first_token(model, make_scheduler):
    """Issue 30 item 9: each chunk of a long prompt calls on_progress (the worker turns it into a
    keep-alive the gateway's event deadline counts), all before the first token."""
    s = make_scheduler(cache_bytes=0, prefill_chunk=8)
    s.start()
    run = Run(prompt_for(5, 100), temperature=0, max_tokens=2)
    progress: list[bool] = []
    run.req.on_progress = lambda: progress.append(run.first.is_set())
    run.submit(s).wait()
    # 100 tokens in chunks of 8: at least the 11 chunks before the last report, none after it.
    assert len(progress) >= 10 and not any(progress)


def test_multi_turn_prefix_cache_hit_gives_identical_output(model, make_scheduler):
    s = make_scheduler()
    s.start()
    turn1 = prompt_for(5, 40)
    out1 = greedy(s, turn1, 10).tokens
    turn2 = turn1 + out1 + prompt_for(6, 15)
    second = greedy(s, turn2, 12)
    assert second.cached_at_first_step == len(turn1) + kept_output(s, out1)
    assert s.stats()["cache_hits"] >= 1

    cold = make_scheduler(cache_bytes=0)
    cold.start()
    fresh = greedy(cold, turn2, 12)
    assert fresh.cached_at_first_step == 0
    assert second.tokens == fresh.tokens == reference(model, turn2, 12)


def test_shared_system_prompt_and_exact_repeat(model, make_scheduler):
    s = make_scheduler()
    s.start()
    system = prompt_for(7, 50)
    a = greedy(s, system + prompt_for(8, 10), 5)
    b = greedy(s, system + prompt_for(9, 10), 5)
    assert b.cached_at_first_step >= len(system)
    assert b.tokens == reference(model, system + prompt_for(9, 10), 5)
    again = greedy(s, system + prompt_for(8, 10), 5)
    assert again.cached_at_first_step == len(system) + 10 - 1  # all but the last token
    assert again.tokens == a.tokens
    stats = s.stats()
    assert stats["cache_lookups"] == 3 and stats["cache_hits"] == 2
    assert stats["cached_tokens_total"] >= len(system) + 59
    assert 0 < stats["cache_bytes"] <= 512 << 20


def test_short_prompts_prefill_together_with_mixed_cache_hits(model, make_scheduler):
    """One batched prefill pass over rows with different cached prefix lengths."""
    s = make_scheduler(max_batch=8)
    s.start()
    system = prompt_for(21, 40)
    first = greedy(s, system + prompt_for(22, 6), 6)
    prompts = [
        system + prompt_for(23, 9),  # hits the system prompt
        prompt_for(24, 12),  # no hit
        system + prompt_for(22, 6) + first.tokens + prompt_for(25, 5),  # hits the whole first turn
        prompt_for(26, 3),
    ]
    runs = [Run(p, temperature=0, max_tokens=10) for p in prompts]
    with s._cv:  # queue all four within one turn so they share one prefill pass
        for r in runs:
            r.handle = s.submit(r.req)
    for p, r in zip(prompts, runs):
        assert r.wait().tokens == reference(model, p, 10)
    assert [r.cached_at_first_step for r in runs][0] >= 40
    assert runs[2].cached_at_first_step == len(system) + 6 + kept_output(s, first.tokens)


def test_prefill_failure_fails_only_its_request(model, make_scheduler):
    poison = 255

    class Poisoned:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, inputs, cache=None):
            if inputs.shape[1] > 1 and (inputs == poison).any().item():
                raise MemoryError("prompt too big")
            return self.inner(inputs, cache=cache)

    s = make_scheduler(cache_bytes=0)
    s._model = s._batch.model = Poisoned(model)
    good = [Run(prompt_for(i, 10), temperature=0, max_tokens=5) for i in range(3)]
    bad = Run([1, 2, poison, 3, 4, 5], temperature=0, max_tokens=5)
    for r in (good[0], bad, good[1], good[2]):
        r.submit(s)
    s.start()  # all four are short: first tried as one batched pass, which fails
    assert bad.wait().finish == "error" and "prompt too big" in bad.steps[-1].error
    for i, r in enumerate(good):
        assert r.wait().tokens == reference(model, prompt_for(i, 10), 5)


def test_prefix_cache_lru_by_bytes(model):
    from mlx_lm.models.cache import make_prompt_cache

    def kv(tokens):
        cache = make_prompt_cache(model)
        model(mx.array(tokens)[None], cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    one = sum(c.nbytes for c in kv(prompt_for(0, 10)))
    pc = PrefixCache(max_bytes=int(one * 2.5))
    seqs = [prompt_for(i, 10) for i in range(3)]
    pc.insert(seqs[0], kv(seqs[0]))
    pc.insert(seqs[1], kv(seqs[1]))
    assert pc.lookup(seqs[0] + [1, 2])[1] == 10  # touch 0: 1 is now least recent
    pc.insert(seqs[2], kv(seqs[2]))
    assert len(pc) == 2 and pc.nbytes <= pc.max_bytes
    assert pc.lookup(seqs[1] + [3])[1] == 0
    assert pc.lookup(seqs[0] + [3])[1] == 10
    # a longer sequence replaces its prefixes; a shorter one is served by trimming
    pc.insert(seqs[0] + [5, 6], kv(seqs[0] + [5, 6]))
    assert len(pc) == 2
    cache, n = pc.lookup(seqs[0][:6] + [99])
    assert n == 6 and all(c.offset == 6 for c in cache)


def test_prefix_cache_entries_are_seen_only_in_their_scope(model):
    """Issue 30 A: one organization's prompts never shorten (or show in cached_tokens of)
    another's; an emptied scope leaves nothing behind."""
    from mlx_lm.models.cache import make_prompt_cache

    def kv(tokens):
        cache = make_prompt_cache(model)
        model(mx.array(tokens)[None], cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    secret = prompt_for(0, 12)
    one = sum(c.nbytes for c in kv(secret))
    pc = PrefixCache(max_bytes=int(one * 1.5))
    pc.insert(secret, kv(secret), "org-a")
    assert pc.lookup(secret + [7], "org-b") == (None, 0)
    assert pc.lookup(secret + [7]) == (None, 0)  # nor the unscoped (local) cache
    assert pc.lookup(secret + [7], "org-a")[1] == 12
    pc.insert(secret, kv(secret), "org-b")  # the same tokens, a separate entry; evicts a's
    assert len(pc) == 1 and pc.lookup(secret + [7], "org-a") == (None, 0)
    assert pc.lookup(secret + [7], "org-b")[1] == 12
    pc.clear()
    pc.insert(secret, kv(secret), "org-c")
    pc.insert(prompt_for(1, 12), kv(prompt_for(1, 12)), "org-d")  # evicts org-c's only entry
    assert "org-c" not in pc._trie._trie and len(pc) == 1


def test_cancel_inside_a_batch(model, make_scheduler):
    s = make_scheduler(cache_bytes=0)
    runs = [Run(prompt_for(i, 8 + i), temperature=0, max_tokens=40 if i != 1 else 100_000).submit(s) for i in range(4)]
    s.start()
    assert runs[1].first.wait(30)
    s.cancel(runs[1].handle)
    runs[1].wait(10)
    assert runs[1].finish == "cancelled" and runs[1].steps[-1].token is None
    assert runs[1].tokens == reference(model, prompt_for(1, 9), len(runs[1].tokens))
    for i in (0, 2, 3):
        assert runs[i].wait().tokens == reference(model, prompt_for(i, 8 + i), 40)
    queued = Run(prompt_for(9, 5), temperature=0, max_tokens=5)
    s2 = make_scheduler()
    queued.submit(s2)
    s2.cancel(queued.handle)
    s2.start()
    assert queued.wait(10).finish == "cancelled"


def test_seeded_sampling_is_batch_independent(model, make_scheduler):
    prompt = prompt_for(10, 12)
    s = make_scheduler(cache_bytes=0)
    s.start()
    alone = Run(prompt, temperature=0.8, top_p=0.9, seed=42, max_tokens=20).submit(s).wait().tokens
    s2 = make_scheduler(cache_bytes=0)
    others = [Run(prompt_for(i, 9), temperature=1.0, max_tokens=20).submit(s2) for i in range(5)]
    mine = Run(prompt, temperature=0.8, top_p=0.9, seed=42, max_tokens=20).submit(s2)
    g = Run(prompt_for(11, 9), temperature=0, max_tokens=20).submit(s2)
    s2.start()
    assert mine.wait().tokens == alone
    assert g.wait().tokens == reference(model, prompt_for(11, 9), 20)
    for r in others:
        r.wait()
    other_seed = Run(prompt, temperature=0.8, top_p=0.9, seed=7, max_tokens=20).submit(s).wait()
    assert other_seed.tokens != alone


def test_logprobs_and_top_logprobs(model, make_scheduler):
    s = make_scheduler()
    s.start()
    run = greedy(s, prompt_for(12, 10), 6, logprobs=True, top_logprobs=5)
    plain = greedy(s, prompt_for(12, 10), 6)
    for st in run.steps:
        assert len(st.top_logprobs) == 5
        values = [lp for _, lp in st.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert st.top_logprobs[0][0] == st.token  # greedy picks the most likely
        assert st.logprob == pytest.approx(values[0])
    assert all(st.logprob is None and st.top_logprobs is None for st in plain.steps)
    lp_only = greedy(s, prompt_for(12, 10), 2, logprobs=True)
    assert lp_only.steps[0].logprob is not None and lp_only.steps[0].top_logprobs is None


def test_logits_processor_per_request_and_failure_isolated(model, make_scheduler):
    def force(token: int):
        def processor(tokens: mx.array, logits: mx.array) -> mx.array:
            mask = mx.arange(logits.shape[-1]) == token
            return mx.where(mask, logits, -mx.inf)

        return processor

    seen = []

    def spy(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(tokens.tolist())
        return logits

    def broken(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.shape[0] > 14:
            raise RuntimeError("grammar exploded")
        return logits

    s = make_scheduler(cache_bytes=0)
    forced = Run(prompt_for(13, 8), temperature=0.7, max_tokens=6, processors=[force(42)]).submit(s)
    watched = Run(prompt_for(14, 8), temperature=0, max_tokens=4, processors=[spy]).submit(s)
    bad = Run(prompt_for(15, 10), temperature=0, max_tokens=20, processors=[broken]).submit(s)
    free = Run(prompt_for(16, 8), temperature=0, max_tokens=20).submit(s)
    s.start()
    assert forced.wait().tokens == [42] * 6
    assert watched.wait().tokens == reference(model, prompt_for(14, 8), 4)
    # the processor sees the whole prompt, then each generated token appended
    assert seen[0] == prompt_for(14, 8)
    assert seen[1] == prompt_for(14, 8) + watched.tokens[:1]
    assert bad.wait().finish == "error" and "grammar exploded" in bad.steps[-1].error
    assert free.wait().tokens == reference(model, prompt_for(16, 8), 20)


def test_model_failure_fails_batch_and_engine_recovers(model, make_scheduler):
    class Flaky:
        def __init__(self, inner):
            self.inner = inner
            self.fail_next_decode = False

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, inputs, cache=None):
            if self.fail_next_decode and inputs.shape[1] == 1:
                self.fail_next_decode = False
                raise RuntimeError("device lost")
            return self.inner(inputs, cache=cache)

    flaky = Flaky(model)
    s = make_scheduler(cache_bytes=0)
    s._model = flaky
    s._batch.model = flaky
    runs = [Run(prompt_for(i, 6), temperature=0, max_tokens=100_000).submit(s) for i in range(3)]
    s.start()
    for r in runs:
        assert r.first.wait(30)
    if s._batch.native is not None:  # packed weights decode natively: fail that step instead
        flaky = s._batch.native = Flaky(s._batch.native)
    flaky.fail_next_decode = True
    for r in runs:
        assert r.wait().finish == "error"
        assert "device lost" in r.steps[-1].error
    after = greedy(s, prompt_for(20, 7), 5)
    assert after.tokens == reference(model, prompt_for(20, 7), 5)


def test_queue_full_and_validation(make_scheduler):
    # Not started, so nothing leaves the queue: one free batch slot plus two queued fit.
    s = make_scheduler(queue_depth=2, max_batch=1)
    for _ in range(3):
        Run([1, 2], temperature=0, max_tokens=1).submit(s)
    with pytest.raises(QueueFull):
        Run([1, 2], temperature=0, max_tokens=1).submit(s)
    with pytest.raises(ValueError):
        Run([], max_tokens=1).submit(s)
    with pytest.raises(ValueError):
        Run([1], top_logprobs=21).submit(s)
    stats = s.stats()
    assert stats["queued"] == 3 and stats["active"] == 0
    assert set(stats) == {"active", "queued", "cache_hits", "cache_lookups", "cached_tokens_total", "cache_bytes",
                          "mlx_active_bytes", "mlx_cache_bytes", "mlx_peak_bytes",
                          "decode_row_steps", "decode_tokens", "speculative_steps", "draft_tokens", "accepted_draft_tokens"}  # fmt: skip


def test_stop_cancels_everything_in_flight(make_scheduler):
    s = make_scheduler(max_batch=1)
    running = Run(prompt_for(1, 5), temperature=0, max_tokens=10_000).submit(s)
    waiting = Run(prompt_for(2, 5), temperature=0, max_tokens=5).submit(s)
    s.start()
    assert running.first.wait(30)
    s.stop()
    assert running.wait(5).finish == "cancelled"
    assert waiting.wait(5).finish == "cancelled"


def test_single_token_prompt(model, make_scheduler):
    s = make_scheduler()
    s.start()
    run = greedy(s, [5], 4)
    assert run.tokens == reference(model, [5], 4)
