"""The native kernels read a GGUF's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS) exactly as gguf-py's
reference dequantizes them, and a Q4_K_M-style model decodes natively straight from its file.

Bounds. Dequantization is bit-exact. A product takes 8-bit activations (per 32 values, scale
max|x| / 127, rounded to nearest), and is then the product of the weights with those rounded
activations x' up to float32 sums: within 1e-5 of sum_l |x'_l| B_l, B_l a bound on the
magnitudes the integer sums of weight l's block reach (its scales times the quant range and
zero point; see ``_block_bound``). Against the exact activations each x_l is off by at most
half its block's scale, so the product is off by at most sum_l |w_l| d_l / 2 more.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
# Byte offsets of each type's float16 block fields (d, and m / dmin where the type has one).
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
              Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}  # fmt: skip


def blocks(rng: np.random.Generator, qtype: Q, rows: int, k: int, scales: str = "random") -> np.ndarray:
    """Random valid blocks: random bytes and float16 scales as asked ("random" 2^-16..2^-4 either
    sign, "max" 65504, "min" the smallest subnormal, "zero"), or every byte 0x00 (scales
    included) / every byte but the scales' 0xFF (the extreme quants and 6-bit scales)."""
    block, size = GGML_QUANT_SIZES[qtype]
    fill = {"zeros": 0, "ones": 255}.get(scales)
    if fill is None:
        out = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    else:
        out = np.full((rows, k // block, size), fill, np.uint8)
    for at in F16_FIELDS[qtype]:
        shape = out.shape[:-1]
        if scales == "random":
            values = np.exp2(rng.uniform(-16, -4, size=shape)) * rng.choice([-1, 1], size=shape)
        else:
            values = np.full(shape, {"max": 65504.0, "min": 2.0**-24, "zero": 0.0, "zeros": 0.0, "ones": 2.0**-8}[scales])
        out[..., at : at + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    return out.reshape(rows, -1)


def _block_bound(b: np.ndarray, qtype: Q, k: int) -> np.ndarray:
    """Per weight, a bound on the magnitudes one block's integer sums are scaled by."""
    block, size = GGML_QUANT_SIZES[qtype]
    per = b.reshape(b.shape[0], -1, size)
    f16 = [np.abs(per[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float64)) for at in F16_FIELDS[qtype]]
    bound = {Q.Q4_0: lambda: f16[0] * 31, Q.Q4_1: lambda: f16[0] * 31 + f16[1], Q.Q5_0: lambda: f16[0] * 63,
             Q.Q5_1: lambda: f16[0] * 63 + f16[1], Q.Q8_0: lambda: f16[0] * 511, Q.Q4_K: lambda: f16[0] * 63 * 15 + f16[1] * 63,
             Q.Q5_K: lambda: f16[0] * 63 * 31 + f16[1] * 63, Q.Q6_K: lambda: f16[0] * 128 * 127,
             Q.IQ4_NL: lambda: f16[0] * 255, Q.IQ4_XS: lambda: f16[0] * 32 * 255}[qtype]()  # fmt: skip
    return np.repeat(bound, block, axis=-1)


def rounded(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8-bit activations' values x' and each value's block scale, as the kernels round."""
    blocks32 = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks32).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    xi = np.rint(blocks32 * inv)
    return (xi * d).reshape(x.shape).astype(np.float64), np.broadcast_to(d, blocks32.shape).reshape(x.shape).astype(np.float64)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scales", ["random", "max", "min", "zero", "zeros", "ones"])
def test_dequantize_is_gguf_py_bit_for_bit(kernel, qtype, scales):
    rng = np.random.default_rng(1)
    b = blocks(rng, qtype, 9, 512, scales)
    ref = quants.dequantize(b, qtype).astype(np.float32)
    np.testing.assert_array_equal(kernel.ggml_dequantize(b, int(qtype), 512), ref)
    np.testing.assert_array_equal(kernel.ggml_dequantize(b, int(qtype), 512, np.array([8, 0, 8])), ref[[8, 0, 8]])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scales", ["random", "max", "min", "zero", "zeros", "ones"])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_product_is_the_reference_product_of_the_rounded_activations(kernel, qtype, scales, rows, k=768):
    rng = np.random.default_rng(2 + rows)
    b = blocks(rng, qtype, 13, k, scales)
    w = quants.dequantize(b, qtype).astype(np.float64)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero activation block
    x[-1, 32:64] *= 1e4  # and an outlier one
    y = kernel.ggml_matmul(x, b, int(qtype), k).astype(np.float64)
    xr, d = rounded(x)
    slack = 1e-5 * (np.abs(xr) @ _block_bound(b, qtype, k).T) + 1e-30
    assert np.all(np.abs(y - xr @ w.T) <= slack)
    # Against the exact activations: each is off by at most half its block's scale.
    assert np.all(np.abs(y - x.astype(np.float64) @ w.T) <= slack + (d / 2) @ np.abs(w).T * (1 + 1e-6))


@pytest.mark.parametrize("qtype", [t for t in TYPES if GGML_QUANT_SIZES[t][0] == 32], ids=lambda t: t.name)
@pytest.mark.parametrize("scales", ["random", "max", "ones"])
@pytest.mark.parametrize("rows", [1, 3])
def test_product_of_rows_not_a_multiple_of_256_wide(kernel, qtype, scales, rows):
    """The 32-weight block types take eight blocks at a time where a row is a multiple of 256
    wide, and one at a time otherwise (800 = 25 blocks): both are the reference product."""
    test_product_is_the_reference_product_of_the_rounded_activations(kernel, qtype, scales, rows, k=800)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scales", ["random", "max", "min", "zero", "zeros", "ones"])
@pytest.mark.parametrize("rows", [16, 45, 200])
def test_prefill_gemm_is_the_reference_product_of_the_rounded_activations(kernel, qtype, scales, rows):
    """The GEMM a prefill chunk's products take (gemm.c, where the build has it): within the same
    bound as the column loops above, over whole and partial tiles of 16 columns and 8 rows."""
    rng = np.random.default_rng(3 + rows)
    k = 512
    b = blocks(rng, qtype, 37, k, scales)
    w = quants.dequantize(b, qtype).astype(np.float64)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0.0
    x[-1, 32:64] *= 1e4
    y = kernel.ggml_gemm(x, b, int(qtype), k).astype(np.float64)
    xr, d = rounded(x)
    slack = 1e-5 * (np.abs(xr) @ _block_bound(b, qtype, k).T) + 1e-30
    assert np.all(np.abs(y - xr @ w.T) <= slack)
    assert np.all(np.abs(y - x.astype(np.float64) @ w.T) <= slack + (d / 2) @ np.abs(w).T * (1 + 1e-6))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 8, 11])
def test_exact_product_is_dequantize_then_multiply(kernel, qtype, rows):
    """The float32 product mlx's forward pass takes for a few rows: the reference product up to
    the order of float32 sums."""
    rng = np.random.default_rng(7 + rows)
    b = blocks(rng, qtype, 13, 768)
    w = quants.dequantize(b, qtype).astype(np.float64)
    x = rng.standard_normal((rows, 768)).astype(np.float32)
    y = kernel.ggml_matmul(x, b, int(qtype), 768, exact=True).astype(np.float64)
    assert np.all(np.abs(y - x @ w.T) <= 1e-5 * (np.abs(x) @ np.abs(w).T))


def test_types_and_widths_outside_the_loops_are_refused(kernel):
    assert kernel.ggml_row_bytes(int(Q.Q4_K), 300) == -1  # not whole super-blocks
    assert kernel.ggml_row_bytes(int(Q.Q3_K), 256) == -1  # not read in place (yet)
    assert kernel.ggml_row_bytes(int(Q.IQ4_NL), 48) == -1  # not whole blocks
    b = blocks(np.random.default_rng(0), Q.Q4_K, 2, 256)
    with pytest.raises(ValueError):
        kernel.ggml_matmul(np.zeros((1, 512), np.float32), b, int(Q.Q4_K), 512)


# ---- whole models --------------------------------------------------------------------------

_SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def tokenizer_md(gguf_path):
    _, md = mx.load(str(gguf_path), return_metadata=True)
    return md


def _load(tmp_path, tokenizer_md, case: str, quant: str, k_types=(Q.Q4_K, Q.Q6_K), k_scale: float = 2.0**-12, rope_factors=None):
    from kiln.worker.loading.loader import load_model

    from .tiny_gguf import CONFIGS, write_pair

    cfg = dict(CONFIGS[case], **_SHAPE)
    gguf_file, _ = write_pair(case, quant, tokenizer_md, tmp_path, config=cfg, k_types=k_types, k_scale=k_scale, rope_factors=rope_factors)
    return load_model(str(gguf_file))


@pytest.mark.parametrize("case", ["llama", "mistral", "qwen2", "qwen3"])
def test_q4_k_m_model_decodes_natively_from_its_blocks(tmp_path, tokenizer_md, case, caplog):
    """A Q4_K_M-style file (Q4_K and Q6_K layers, a Q6_K embedding and head, 256 wide): every
    matrix stays the file's blocks, nothing is dequantized to a float copy, and the native
    decode pass takes the whole model (its build check against mlx passed, the log says)."""
    from kiln.worker.engine.native_decode import NativeDecoder
    from kiln.worker.loading.device import keeps_gguf_blocks
    from kiln.worker.loading.ggml_blocks import GGMLEmbedding, GGMLLinear

    if not keeps_gguf_blocks("auto"):
        pytest.skip("the worker keeps GGUF blocks only on the CPU with the native kernels")
    loaded = _load(tmp_path, tokenizer_md, case, "K")
    model = loaded.model
    assert loaded.info.extra["conversions"] == {"Q4_K": "GGUF blocks", "Q6_K": "GGUF blocks"}
    assert type(model.model.embed_tokens) is GGMLEmbedding
    kinds = [type(m) for _, m in model.named_modules()]
    assert nn.Linear not in kinds and nn.Embedding not in kinds
    assert kinds.count(GGMLLinear) == 7 * len(model.model.layers) + (case == "mistral")
    # No mlx parameter is a matrix: the weights live in the mapped file only.
    from mlx.utils import tree_flatten

    assert all(v.ndim == 1 for _, v in tree_flatten(model.parameters()))
    # Where the build has panel loops (panels.c), every matrix was read once into panels.
    from kiln.worker.loading.ggml_blocks import ggml_weights

    matrices = [w for _, m in model.named_modules() if (w := ggml_weights(m)) is not None]
    assert {w.repacked for w in matrices} == {matrices[0].kernel.panels}
    with caplog.at_level(logging.INFO, logger="kiln.worker.engine.native_decode"):
        decoder = NativeDecoder.build(model)
    assert decoder is not None
    head = 9 if case == "mistral" else 8  # the untied head is one more Q6_K matrix
    assert f"GGUF blocks: Q4_K x 14, Q6_K x {head}" in caplog.text


def test_q4_1_file_with_a_q6_k_head_decodes_natively_from_its_blocks(tmp_path, tokenizer_md):
    """A Q4_1 file as llama-quantize writes it (Q4_1 layers, a Q6_K embedding and head) keeps
    every matrix as the file's blocks, Q4_1 included, and the native pass takes the whole model:
    in mlx's layout its head was float16, which the pass does not read, and it decoded through
    mlx alone. (The bundled Q4_1 file, with a Q8_0 embedding, keeps mlx's layout.)"""
    from kiln.worker.engine.native_decode import NativeDecoder
    from kiln.worker.loading.device import keeps_gguf_blocks

    if not keeps_gguf_blocks("auto"):
        pytest.skip("the worker keeps GGUF blocks only on the CPU with the native kernels")
    loaded = _load(tmp_path, tokenizer_md, "llama", "K", k_types=(Q.Q4_1, Q.Q6_K), k_scale=RANDOM_BLOCK_SCALES["Q6_K"])
    assert loaded.info.extra["conversions"] == {"Q4_1": "GGUF blocks", "Q6_K": "GGUF blocks"}
    decoder = NativeDecoder.build(loaded.model)
    assert decoder is not None and "Q4_1 x" in decoder.blocks and "Q6_K x" in decoder.blocks


# Types gguf-py writes from floats, and those written as random blocks with the super-block (or
# block) scale that keeps a random model's activations as tame as Q4_K's at 2^-12: the scale
# times the widest integer weight the type holds (Q4_K 63 * 15, Q5_K 63 * 31, Q6_K 32 * 128,
# IQ4_NL 127, IQ4_XS 32 * 127).
QUANTIZED_FROM_FLOATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
RANDOM_BLOCK_SCALES = {"Q4_K": 2.0**-12, "Q5_K": 2.0**-13, "Q6_K": 2.0**-15, "IQ4_NL": 2.0**-9, "IQ4_XS": 2.0**-15}


@pytest.mark.parametrize("quant", [*QUANTIZED_FROM_FLOATS, *RANDOM_BLOCK_SCALES])
def test_model_in_each_type_matches_mlx_step_by_step(tmp_path, tokenizer_md, quant, monkeypatch):
    """A tiny llama stored in one type (every matrix, embedding and head included), kept as
    blocks: the native pass's logits equal mlx's forward pass (which multiplies the exactly
    dequantized blocks) within the build check's INT8 tolerance, over batched steps."""
    from kiln.worker.engine.native_decode import INT8, NativeDecoder
    from kiln.worker.loading import gguf as gguf_loader
    from kiln.worker.loading.device import keeps_gguf_blocks

    from .test_native import prefilled, prompts_for

    if not keeps_gguf_blocks("auto"):
        pytest.skip("the worker keeps GGUF blocks only on the CPU with the native kernels")
    monkeypatch.setattr(gguf_loader, "KEPT_TYPES", frozenset({quant}))
    if quant in RANDOM_BLOCK_SCALES:
        loaded = _load(tmp_path, tokenizer_md, "llama", "K", k_types=(Q[quant],), k_scale=RANDOM_BLOCK_SCALES[quant])
    else:
        loaded = _load(tmp_path, tokenizer_md, "llama", quant)
    model = loaded.model
    assert loaded.info.extra["conversions"] == {quant: "GGUF blocks"}
    decoder = NativeDecoder.build(model)
    assert decoder is not None and f"GGUF blocks: {quant} x" in decoder.blocks
    vocab = model.model.embed_tokens.num_embeddings
    prompts = prompts_for(3, vocab)
    ref_cache, ours_cache = prefilled(model, prompts), prefilled(model, prompts)
    step = mx.array([[(3 * r + 11 * t + 5) % vocab for t in range(3)] for r in range(3)])
    for _ in range(4):
        ref = np.array(model(step, cache=ref_cache))
        ours = decoder.forward(step, ours_cache)
        assert INT8.agree(ours, ref)
        step = mx.array(ref[:, -1].argmax(-1)[:, None])


def test_rope_freqs_file_takes_the_native_path(tmp_path, tokenizer_md, monkeypatch):
    """A Llama 3-style Q4_K_M file with a ``rope_freqs`` tensor (factors that change every
    rotation but the fastest) decodes on the native pass: its build check against mlx's forward
    pass (the factors applied through mx.fast.rope) passes, and the pass's logits equal mlx's
    step by step. A pass that rotated by the plain frequencies instead is refused by the same
    check, so the check sees the factors."""
    from kiln.worker.engine import native_decode
    from kiln.worker.engine.native_decode import INT8, NativeDecoder
    from kiln.worker.loading.device import keeps_gguf_blocks
    from kiln.worker.loading.gguf import FactorRoPE

    from .test_native import prefilled, prompts_for

    if not keeps_gguf_blocks("auto"):
        pytest.skip("the worker keeps GGUF blocks only on the CPU with the native kernels")
    half = _SHAPE["head_dim"] // 2
    factors = np.geomspace(1.0, 40.0, half).astype(np.float32)  # Llama 3's range: 1 to ~32
    model = _load(tmp_path, tokenizer_md, "llama", "K", rope_factors=factors).model
    assert all(type(layer.self_attn.rope) is FactorRoPE for layer in model.model.layers)
    decoder = NativeDecoder.build(model)
    assert decoder is not None and "GGUF blocks: Q4_K x" in decoder.blocks
    vocab = model.model.embed_tokens.num_embeddings
    prompts = prompts_for(2, vocab)
    ref_cache, ours_cache = prefilled(model, prompts), prefilled(model, prompts)
    step = mx.array([[(5 * r + 7 * t + 3) % vocab for t in range(2)] for r in range(2)])
    for _ in range(4):
        ref = np.array(model(step, cache=ref_cache))
        assert INT8.agree(decoder.forward(step, ours_cache), ref)
        step = mx.array(ref[:, -1].argmax(-1)[:, None])

    def plain(rope):
        half = rope.dims // 2
        return 10000.0 ** (-np.arange(half, dtype=np.float64) / half), True

    monkeypatch.setattr(native_decode, "rope_frequencies", plain)
    assert NativeDecoder.build(model) is None


# Files as llama-quantize mixes them (quant, the K types per layer; the embedding and head Q6_K
# where it is one of them, as in Q4_K_M / Q5_K_M files), and what each kept type's product is.
FILES = {
    "Q4_K_M": ("K", (Q.Q4_K, Q.Q6_K)), "Q5_K_M": ("K", (Q.Q5_K, Q.Q6_K)), "Q8_0": ("Q8_0", ()), "Q4_0": ("Q4_0", ()),
    "Q5_0": ("Q5_0", ()), "Q5_1": ("Q5_1", ()), "IQ4_NL": ("K", (Q.IQ4_NL,)), "IQ4_XS": ("K", (Q.IQ4_XS,)),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(FILES))
def test_file_serves_through_the_scheduler_on_the_native_path(tmp_path, tokenizer_md, kind):
    """End to end in the engine, with the worker's own choice of what stays blocks: every
    quantized matrix of the file stays its blocks (nothing converted), the scheduler takes the
    native pass for it, a short prompt prefills natively, a long one in chunks (natively where
    the build has the GEMM, else through mlx's dequantized pieces), and each first greedy token
    is mlx's, or one within the build check's INT8 margin of it (2.5x that after a chunked
    prefill): a random model's near tie that 8-bit activations may flip."""
    from kiln.worker.engine.native_decode import INT8
    from kiln.worker.engine.scheduler import Scheduler
    from kiln.worker.loading.device import keeps_gguf_blocks

    from .test_engine import Run

    if not keeps_gguf_blocks("auto"):
        pytest.skip("the worker keeps GGUF blocks only on the CPU with the native kernels")
    quant, k_types = FILES[kind]
    scale = min(RANDOM_BLOCK_SCALES[t.name] for t in k_types) if k_types else 2.0**-12
    loaded = _load(tmp_path, tokenizer_md, "llama", quant, k_types=k_types, k_scale=scale)
    stored = {t.name for t in k_types} or {quant}
    assert loaded.info.extra["conversions"] == dict.fromkeys(sorted(stored), "GGUF blocks")
    model = loaded.model
    vocab = model.model.embed_tokens.num_embeddings
    s = Scheduler(model, cache_bytes=0, max_batch=4, prefill_chunk=64)
    s.start()
    try:
        prompts = [[(7 * j + 1) % vocab for j in range(9)], [(13 * j + 5) % vocab for j in range(300)]]
        runs = [Run(p, temperature=0, max_tokens=6).submit(s) for p in prompts]
        for p, r, margin in zip(prompts, runs, (INT8.decided, 2.5 * INT8.decided), strict=True):
            assert len(r.wait(timeout=300).tokens) == 6
            logits = np.array(model(mx.array([p]))[0, -1])
            # The long prompt's five chunks each round their activations to 8 bits (the GEMM's
            # prefill): a wider margin than one pass's.
            assert logits[r.tokens[0]] >= logits.max() - margin
        assert s._batch.native is not None
        assert all(f"{t} x" in s._batch.native.blocks for t in stored)
    finally:
        s.stop()


def test_q4_1_file_keeps_its_blocks(tmp_path, tokenizer_md):
    """Q4_1 (the bundled model's type) stays the file's blocks as every other type the kernels
    read, its Q8_0 embedding too: no affine copy, no float32 prefill copy."""
    from kiln.worker.loading.device import keeps_gguf_blocks

    if not keeps_gguf_blocks("auto"):
        pytest.skip("the worker keeps GGUF blocks only on the CPU with the native kernels")
    loaded = _load(tmp_path, tokenizer_md, "llama", "Q4_1")
    assert set(loaded.info.extra["conversions"].values()) == {"GGUF blocks"}


def _gemm_model(tmp_path, tokenizer_md) -> nn.Module:
    """A Q4_K_M-style llama file loaded as the worker loads it, where its prompts can go through
    the native pass's GEMM or panel loops (else the test skips: elsewhere they go through mlx)."""
    from kiln.worker.loading.device import keeps_gguf_blocks
    from kiln.worker.native.build import cpu_kernels

    if not keeps_gguf_blocks("auto"):
        pytest.skip("the worker keeps GGUF blocks only on the CPU with the native kernels")
    kernels = cpu_kernels()
    if kernels is None or not (kernels.gemm or kernels.panels):
        pytest.skip("this build has neither the prefill GEMM nor panel loops: prompts go through mlx")
    return _load(tmp_path, tokenizer_md, "llama", "K").model


def test_long_prompt_of_a_q4_k_m_file_prefills_through_the_native_pass(tmp_path, tokenizer_md, monkeypatch):
    """A prompt longer than a chunk, on a Q4_K_M-style file: every chunk goes through the native
    pass (its GEMM, or its panel loops), none through mlx's forward pass, and the request's first token is mlx-lm's."""
    from kiln.worker.engine import prefill as prefill_module
    from kiln.worker.engine.native_decode import NativeDecoder
    from kiln.worker.engine.scheduler import Scheduler

    from .test_engine import Run, reference

    model = _gemm_model(tmp_path, tokenizer_md)
    vocab = model.model.embed_tokens.num_embeddings
    prompt = [(11 * j + 3) % vocab for j in range(300)]
    expected = reference(model, prompt, 1)[0]
    native_chunks: list[int] = []
    mlx_chunks: list[int] = []
    original_prefill, original_run_chunk = NativeDecoder.prefill, prefill_module.Prefill.run_chunk

    def recording_prefill(self, tokens, cache):
        native_chunks.append(int(np.asarray(tokens).size))
        return original_prefill(self, tokens, cache)

    def recording_run_chunk(self, model, native=None):
        done = original_run_chunk(self, model, native)
        if self.native_cache is None:
            mlx_chunks.append(done)
        return done

    monkeypatch.setattr(NativeDecoder, "prefill", recording_prefill)
    monkeypatch.setattr(prefill_module.Prefill, "run_chunk", recording_run_chunk)
    s = Scheduler(model, cache_bytes=0, max_batch=4, prefill_chunk=64)
    s.start()
    try:
        run = Run(prompt, temperature=0, max_tokens=2).submit(s)
        assert len(run.wait(timeout=300).tokens) == 2
        assert s._native is not None and s._native.prefill_rows > 0
    finally:
        s.stop()
    # 299 prompt tokens (the last is the decode step's): four chunks of 64, then the last 43.
    assert native_chunks == [64, 64, 64, 64, 43] and mlx_chunks == []
    assert run.tokens[0] == expected


def test_short_prompts_of_different_lengths_prefill_through_the_native_pass(tmp_path, tokenizer_md, monkeypatch):
    """Short prompts of different token counts (and one with a cached prefix) queued within one
    turn, on a Q4_K_M-style file: every row's prompt goes through the native pass in runs of
    equal lengths, none through mlx's padded forward pass (which dequantizes the blocks for
    BLAS: it made eight streams of a 1B file 2.3x slower, depending on how they were grouped),
    and each request's first token is mlx-lm's."""
    from kiln.worker.engine.native_decode import NativeDecoder
    from kiln.worker.engine.scheduler import Scheduler

    from .test_engine import Run, reference

    model = _gemm_model(tmp_path, tokenizer_md)
    vocab = model.model.embed_tokens.num_embeddings
    system = [(7 * j + 5) % vocab for j in range(20)]
    prompts = [
        [(11 * j + 3) % vocab for j in range(30)],
        [(13 * j + 1) % vocab for j in range(31)],
        [(17 * j + 2) % vocab for j in range(31)],
        system + [(19 * j + 4) % vocab for j in range(9)],  # the system prompt cached below
    ]
    native_rows: list[tuple[int, int]] = []
    mlx_passes: list[tuple[int, ...]] = []
    original_prefill = NativeDecoder.prefill

    def recording_prefill(self, tokens, cache):
        native_rows.append(tuple(np.asarray(tokens).shape))
        return original_prefill(self, tokens, cache)

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, inputs, cache=None):
            if inputs.shape[1] > 1:
                mlx_passes.append(tuple(inputs.shape))
            return self.inner(inputs, cache=cache)

    s = Scheduler(model, cache_bytes=64 << 20, max_batch=8)
    s.start()
    assert s.wait_set_up(timeout=300)
    s._model = s._batch.model = Recording(model)  # after the native pass is built on the model itself
    try:
        Run(system + [(23 * j + 6) % vocab for j in range(5)], temperature=0, max_tokens=1).submit(s).wait(timeout=300)
        monkeypatch.setattr(NativeDecoder, "prefill", recording_prefill)
        runs = [Run(p, temperature=0, max_tokens=2) for p in prompts]
        with s._cv:  # queued within one turn, so that they share one group
            for r in runs:
                r.handle = s.submit(r.req)
        for r in runs:
            assert len(r.wait(timeout=300).tokens) == 2
        assert s._native is not None and s._native.prefill_rows > 0
    finally:
        s.stop()
    assert mlx_passes == []
    # In the queue's order: the 29 tokens left of the first, the next two (30 each) together,
    # the last one's 8 after its 20 cached (each prompt's last token is the decode step's).
    assert native_rows == [(1, 29), (2, 30), (1, 8)]
    for p, r in zip(prompts, runs, strict=True):
        assert r.tokens[0] == reference(model, p, 1)[0]
