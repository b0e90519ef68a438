"""The native CPU kernel multiplies exactly what mlx's dequantize gives, for every shape it takes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiln.worker.native.build import cpu_kernels


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels()
    if k is None:
        pytest.skip("no C compiler for the native CPU kernels")
    return k


def quantized(out_dims: int, in_dims: int, bits: int, group_size: int, seed: int):
    mx.random.seed(seed)
    w = mx.random.normal((out_dims, in_dims)) * 0.1
    q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    dense = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)
    return np.array(q).view(np.uint8), np.array(scales), np.array(biases), np.array(dense)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_matches_dequantized_matmul(kernel, bits, group_size, rows):
    q, scales, biases, dense = quantized(77, 384, bits, group_size, seed=bits * group_size + rows)
    x = np.random.default_rng(rows).standard_normal((rows, 384)).astype(np.float32)
    y = kernel.matmul(x, q, scales, biases, bits, group_size)
    np.testing.assert_allclose(y, x @ dense.T, rtol=1e-4, atol=1e-4)


def test_rows_beyond_the_kernel_are_refused(kernel):
    q, scales, biases, _ = quantized(8, 64, 4, 32, seed=1)
    with pytest.raises(ValueError):
        kernel.matmul(np.zeros((kernel.max_rows + 1, 64), np.float32), q, scales, biases, 4, 32)


def test_built_once_and_reused(kernel):
    assert cpu_kernels() is kernel


@pytest.mark.parametrize("setting", ["off", "no compiler", "compile error"])
def test_without_kernels_the_worker_keeps_float32(monkeypatch, tmp_path, setting):
    """Turned off, or with no working C compiler, there are no kernels and quantized layers
    become plain float32 layers (the worker's float32 path) instead of failing."""
    import mlx.nn as nn

    from kiln.worker.loading.device import dequantize_modules
    from kiln.worker.native import build as native

    monkeypatch.setenv("KILN_NATIVE_CACHE", str(tmp_path))
    if setting == "off":
        monkeypatch.setenv("KILN_NATIVE_KERNELS", "0")
    elif setting == "no compiler":
        monkeypatch.setattr(native, "_compiler", lambda: None)
    else:
        monkeypatch.setattr(native, "_compiler", lambda: "false")  # exits 1 without output
    native.cpu_kernels.cache_clear()
    try:
        assert native.cpu_kernels() is None
    finally:
        native.cpu_kernels.cache_clear()
    layer = nn.QuantizedLinear(64, 32, group_size=32, bits=4)
    model = nn.Sequential(layer)
    dequantize_modules(model, mx.float32, None)
    assert type(model.layers[0]) is nn.Linear


# ---- the builds: one per instruction set, the first this CPU runs --------------------------


def test_forced_portable_takes_the_baseline_build(monkeypatch, tmp_path):
    """KILN_NATIVE_PORTABLE=1 takes the build without -march flags (what a CPU without the fast
    instructions gets), with float32 activations."""
    from kiln.worker.native import build as native

    if native._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("KILN_NATIVE_PORTABLE", "1")
    monkeypatch.setenv("KILN_NATIVE_CACHE", str(tmp_path))
    native.cpu_kernels.cache_clear()
    try:
        portable = native.cpu_kernels()
    finally:
        native.cpu_kernels.cache_clear()
    assert portable is not None and portable.variant == "portable" and not portable.int8


def test_a_named_build_starts_the_search(monkeypatch, caplog):
    """KILN_NATIVE_VARIANT=avx2 on an AVX-512 CPU tries the avx2 build first (then the slower
    ones), as an AVX2-only CPU would; a name this CPU cannot run is a warning, and the usual
    order."""
    from kiln.worker.native import build as native

    flags = {"avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    monkeypatch.setattr(native, "_cpu_flags", lambda: ("", flags))
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(native.VARIANT_ENV, "AVX2")
    assert [v.name for v in native._candidates()] == ["avx2", "portable"]
    monkeypatch.setenv(native.VARIANT_ENV, "dotprod")
    with caplog.at_level("WARNING"):
        assert [v.name for v in native._candidates()] == ["avx512vnni", "avxvnni", "avx2", "portable"]
    assert "KILN_NATIVE_VARIANT=dotprod" in caplog.text


def test_builds_that_fail_or_do_not_run_here_are_passed_over(monkeypatch, tmp_path):
    """A variant that does not compile, or whose self-test fails in the child process (a CPU
    without its instructions: the CPUID check refuses, or SIGILL kills the child), is passed
    over for the next, down to the portable build; the worker never runs it."""
    from kiln.worker.native import build as native

    if native._compiler() is None:
        pytest.skip("no C compiler")
    _, flags = native._cpu_flags()
    foreign = next((v for v in native.variants() if flags is not None and not v.needs <= flags), None)
    if foreign is None:
        pytest.skip("this CPU runs every variant")
    broken = native.Variant("broken", ("-mno-such-flag",), frozenset())
    monkeypatch.setenv("KILN_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_candidates", lambda: [broken, foreign, native.PORTABLE])
    native.cpu_kernels.cache_clear()
    try:
        chosen = native.cpu_kernels()
    finally:
        native.cpu_kernels.cache_clear()
    assert chosen is not None and chosen.variant == "portable"
    assert native._runs_here(native._build(native._compiler(), foreign)) is False
    assert native._runs_here(tmp_path / "kiln-missing.so") is False


# ---- the whole forward pass against mlx's ----------------------------------------------------
#
# Models from tiny GGUF files as the loader reads them (llama, qwen2, qwen3 in Q4_0, Q4_1 and
# Q8_0), and the scaled-up random models of test_engine, whose greedy output is decided enough
# to compare token for token. The pass takes 8-bit activations where this CPU has integer dot
# products: it must then agree with mlx within the build check's Tolerance at every step.

ARCHS = ("llama", "qwen2", "qwen3")
QUANTS = ("Q4_0", "Q4_1", "Q8_0")


@pytest.fixture(scope="module")
def tokenizer_md(gguf_path):
    _, md = mx.load(str(gguf_path), return_metadata=True)
    return md


@pytest.fixture(scope="module", params=[(a, q) for a in ARCHS for q in QUANTS], ids=lambda p: "-".join(p))
def loader_model(request, tmp_path_factory, tokenizer_md, kernel):
    from kiln.worker.loading.loader import load_model

    from .tiny_gguf import write_pair

    case, quant = request.param
    gguf_file, _ = write_pair(case, quant, tokenizer_md, tmp_path_factory.mktemp(f"{case}-{quant}"))
    return load_model(str(gguf_file)).model


def prefilled(model, prompts: list[list[int]]):
    """mlx-lm BatchKVCaches holding the left-padded prompts, prefilled by mlx."""
    from mlx_lm.models.cache import BatchKVCache

    width = max(len(p) for p in prompts)
    cache = [BatchKVCache([width - len(p) for p in prompts]) for _ in model.model.layers]
    model(mx.array([[0] * (width - len(p)) + p for p in prompts]), cache=cache)
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def copied(cache):
    """An independent copy of BatchKVCaches (the native pass writes into their buffers)."""
    from mlx_lm.models.cache import BatchKVCache

    out = []
    for c in cache:
        new = BatchKVCache([0])
        new.state = (mx.array(np.array(c.keys)), mx.array(np.array(c.values)), c.offset, c.left_padding, c._idx)
        out.append(new)
    return out


def prompts_for(rows: int, vocab: int, longest: int = 14) -> list[list[int]]:
    return [[(31 * r + 7 * j + 1) % vocab for j in range(longest - (5 * r) % (longest - 2))] for r in range(rows)]


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_forward_pass_agrees_with_mlx(loader_model, kernel, rows):
    """Left-padded batches of 1-8 rows: three new tokens at once, then single steps, fed mlx's
    greedy tokens; every step's logits within the tolerance (KL bound, same greedy token where
    decided), with 8-bit activations wherever this CPU has integer dot products."""
    from kiln.worker.engine.native_decode import FLOAT32, INT8, NativeDecoder

    decoder = NativeDecoder.build(loader_model)
    assert decoder is not None and decoder.int8 == kernel.int8
    tolerance = INT8 if decoder.int8 or decoder.blocks else FLOAT32  # blocks: 8-bit always
    vocab = loader_model.args.vocab_size
    prompts = prompts_for(rows, vocab)
    ref_cache = prefilled(loader_model, prompts)
    ours_cache = prefilled(loader_model, prompts)
    step = mx.array([[(3 * r + 11 * t + 5) % vocab for t in range(3)] for r in range(rows)])
    for _ in range(5):
        ref = np.array(loader_model(step, cache=ref_cache))
        ours = decoder.forward(step, ours_cache) if step.shape[1] > 1 else decoder(step, ours_cache)[:, None]
        assert ours.shape == ref.shape
        assert tolerance.agree(ours, ref)
        step = mx.array(ref[:, -1].argmax(-1)[:, None])
    assert ours_cache[0]._idx == ref_cache[0]._idx
    assert np.array_equal(np.array(ours_cache[0].offset), np.array(ref_cache[0].offset))


def test_several_new_tokens_equal_single_steps(loader_model):
    """forward(tokens (B, T)) gives each token the logits T single steps give it (the rows and
    tokens of one pass do not mix), and leaves the same cache."""
    from kiln.worker.engine.native_decode import NativeDecoder

    decoder = NativeDecoder.build(loader_model)
    vocab = loader_model.args.vocab_size
    cache = prefilled(loader_model, prompts_for(4, vocab))
    other = copied(cache)
    tokens = np.array([[(5 * r + 3 * t + 2) % vocab for t in range(4)] for r in range(4)], np.int32)
    together = decoder.forward(tokens, cache)
    singly = np.stack([decoder(tokens[:, t : t + 1], other) for t in range(4)], axis=1)
    if decoder.blocks and decoder._kernels.gemm:
        # 16 rows of GGUF blocks take the GEMM, whose float sums run in another order than the
        # one-row loops': a value at a rounding edge of the next product's 8-bit activations may
        # then round the other way, so the two agree within the build check's INT8 tolerance.
        from kiln.worker.engine.native_decode import INT8

        assert INT8.agree(together, singly)
    else:
        np.testing.assert_allclose(together, singly, rtol=1e-5, atol=1e-5)
    assert cache[0]._idx == other[0]._idx
    ours, theirs = np.array(cache[-1].keys)[:, :, : cache[-1]._idx], np.array(other[-1].keys)[:, :, : other[-1]._idx]
    if decoder.blocks and decoder._kernels.gemm:  # the GEMM's order of float sums, as above
        np.testing.assert_allclose(ours, theirs, rtol=1e-2, atol=1e-2)
    else:
        np.testing.assert_array_equal(ours, theirs)


def test_cache_grows_through_its_capacity(kernel, monkeypatch):
    """Steps past the cache buffers' 256 positions grow them (keeping what they hold), as
    mlx-lm's own update does, and keep matching mlx (float32 activations: this scaled-up
    model amplifies 8-bit rounding over a long context past the check's bound)."""
    from kiln.worker.engine.native_decode import FLOAT32, NativeDecoder

    from .test_engine import packed_tiny_llama

    monkeypatch.setenv("KILN_NATIVE_ACTIVATIONS", "float32")
    model = packed_tiny_llama()
    decoder = NativeDecoder.build(model)
    prompts = [[(3 * j + 1) % 256 for j in range(250)], [(5 * j + 2) % 256 for j in range(240)]]
    ref_cache, ours_cache = prefilled(model, prompts), prefilled(model, prompts)
    assert np.array(ours_cache[0].keys).shape[2] == 256
    step = mx.array([[7], [9]])
    for _ in range(12):
        ref = np.array(model(step, cache=ref_cache)[:, -1])
        assert FLOAT32.agree(decoder(step, ours_cache), ref)
        step = mx.array(ref.argmax(-1)[:, None])
    assert np.array(ours_cache[0].keys).shape[2] == 512


def greedy_tokens(model, decoder, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens per row, decoded by mlx's forward pass (decoder None) or the native one."""
    cache = prefilled(model, [p[:-1] for p in prompts])
    step = mx.array([[p[-1]] for p in prompts])
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        logits = np.array(model(step, cache=cache)[:, -1]) if decoder is None else decoder(step, cache)
        picks = logits.argmax(-1)
        for row, t in zip(out, picks, strict=False):
            row.append(int(t))
        step = mx.array(picks[:, None])
    return out


@pytest.fixture(scope="module")
def portable_kernel():
    """The portable build, as a CPU without AVX2/VNNI/dotprod gets it (KILN_NATIVE_PORTABLE=1)."""
    import os

    from kiln.worker.native import build as native

    saved = os.environ.get(native.PORTABLE_ENV)
    os.environ[native.PORTABLE_ENV] = "1"
    native.cpu_kernels.cache_clear()
    try:
        built = native.cpu_kernels()
    finally:
        native.cpu_kernels.cache_clear()
        if saved is None:
            del os.environ[native.PORTABLE_ENV]
        else:
            os.environ[native.PORTABLE_ENV] = saved
    if built is None:
        pytest.skip("no C compiler")
    return built


@pytest.mark.parametrize("arch", ARCHS)
def test_portable_build_decodes_the_same_tokens(kernel, portable_kernel, arch, monkeypatch):
    """test_engine's scaled-up random models (4-bit): in float32 activations the native pass
    decodes mlx's greedy tokens token for token, over batches of 1, 4 and 8 left-padded rows, on
    this CPU's build and on the portable one a CPU without the fast instructions gets. (8-bit
    activations may flip a near tie of these random models, so they are held to the
    tolerance at every step instead: test_forward_pass_agrees_with_mlx.)"""
    import mlx.nn as nn

    from kiln.worker.engine.native_decode import NativeDecoder
    from kiln.worker.loading.device import cast_floating, dequantize_modules

    from . import test_engine

    monkeypatch.setenv("KILN_NATIVE_ACTIVATIONS", "float32")

    def packed(with_kernel):
        monkeypatch.setattr(test_engine, "cpu_kernels", lambda: with_kernel)
        if arch != "llama":
            return test_engine.tiny_qwen(int(arch[-1]))
        m = test_engine.tiny_llama()
        nn.quantize(m, group_size=32, bits=4)
        cast_floating(m, mx.float16)
        dequantize_modules(m, mx.float32, with_kernel)
        mx.eval(m.parameters())
        return m

    decoders = {}
    for build in (kernel, portable_kernel):
        model = packed(build)
        decoders[build.variant] = (model, NativeDecoder.build(model))
        assert decoders[build.variant][1] is not None and decoders[build.variant][1]._kernels is build
    for rows in (1, 4, 8):
        prompts = [[(7 * j + 13 * r + 1) % 256 for j in range(5 + 3 * r)] for r in range(rows)]
        for model, decoder in decoders.values():
            assert greedy_tokens(model, decoder, prompts, 8) == greedy_tokens(model, None, prompts, 8)


def test_team_size_follows_the_faster_measurement(monkeypatch):
    """The pass's thread count is measured on the live steps (interleaved trials of each size)
    and the faster kept until the next measurement; a user's OMP_NUM_THREADS stays fixed."""
    from kiln.worker.native import threads

    clock = [0.0]
    monkeypatch.setattr(threads.time, "perf_counter", lambda: clock[0])
    applied = []
    team = threads.TeamSize(2, applied.append, fixed=False)
    cost = {2: 4.0, 1: 1.0}  # one thread is faster here (a busy machine)
    for _ in range(2 * threads.TRIALS + 5):
        with team.step(tokens=1):
            clock[0] += cost[team.current]
    assert team.current == 1
    cost = {2: 0.5, 1: 1.0}  # the machine got quiet: the next measurement goes back to two
    for _ in range(threads.EVERY):
        with team.step(tokens=1):
            clock[0] += cost[team.current]
    assert team.current == 2
    fixed = threads.TeamSize(2, applied.append, fixed=True)
    with fixed.step(tokens=1):
        pass
    assert fixed.current == 2


def test_only_the_thread_that_claims_the_team_computes_on_it(kernel):
    """libgomp throttles every pool of threads once a second thread has one of its own
    (CpuKernels.claim_team), which made the decode step twice as slow: so the thread that claims
    the team (the engine's) computes on all of it, and any other thread on one."""
    import threading

    seen = {}

    def other():
        seen["other"] = kernel.threads_here()

    def engine():
        kernel.claim_team()
        seen["owner"] = kernel.threads_here()
        helper = threading.Thread(target=other)
        helper.start()
        helper.join()

    owner = threading.Thread(target=engine)
    owner.start()
    owner.join()
    assert seen == {"owner": kernel.team.current, "other": 1}
    assert kernel.threads_here() == 1  # the test's own thread does not own it either


def test_native_prefill_leaves_the_cache_mlx_leaves(loader_model):
    """Prompts of one length prefilled by the native pass (KV only, as the scheduler's short
    groups are) give the next step the logits mlx's own prefill gives it, within tolerance."""
    from kiln.worker.engine.native_decode import FLOAT32, INT8, NativeDecoder

    decoder = NativeDecoder.build(loader_model)
    vocab = loader_model.args.vocab_size
    prompts = [[(13 * r + 5 * j + 3) % vocab for j in range(11)] for r in range(3)]
    ours = prefilled(loader_model, [[1]] * 3)  # a cached past of one token, then the prompts
    theirs = prefilled(loader_model, [[1] + p for p in prompts])
    decoder.prefill(np.array(prompts, np.int32), ours)
    step = mx.array([[7], [8], [9]])
    ref = np.array(loader_model(step, cache=theirs)[:, -1])
    assert (INT8 if decoder.int8 or decoder.blocks else FLOAT32).agree(decoder(step, ours), ref)
