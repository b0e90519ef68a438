"""The polynomial exp that replaces mlx's slow CPU exp in attention and SwiGLU (worker/engine/cpu_exp.py).

Each piece against mlx's own: the exp over float32's range, SiLU, and attention for every mask
the models pass (none, causal with a cached prefix, boolean padding masks with rows that see
nothing), in one block and in many; then the bundled model with it installed: the same logits
as without, to float32 accuracy, and the same greedy continuation of a long prompt.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kiln.worker.engine import cpu_exp


def _rel(ours: mx.array, ref: mx.array) -> float:
    return mx.max(mx.abs(ours - ref) / mx.maximum(mx.abs(ref), 1e-30)).item()


def test_exp_is_accurate_over_floats_range():
    x = mx.linspace(-87.0, 88.0, 200_001)
    assert _rel(cpu_exp.exp(x), mx.exp(x)) < 3e-7
    # Below the range it stands for 0 (a masked score's weight), never a NaN or a negative.
    tiny = cpu_exp.exp(mx.array([-1e30, -200.0, -mx.inf]))
    assert mx.all(tiny >= 0).item() and mx.all(tiny < 1e-37).item()


def test_swiglu_equals_silu_times_x():
    gate = mx.random.normal((33, 257), key=mx.random.key(1)) * 10
    x = mx.random.normal((33, 257), key=mx.random.key(2))
    ref = nn.silu(gate) * x
    assert mx.allclose(cpu_exp.swiglu(gate, x), ref, rtol=1e-5, atol=1e-6).item()


def _qkv(rows: int, positions: int, heads: int = 9, kv_heads: int = 3, dim: int = 64, batch: int = 2):
    k1, k2, k3 = mx.random.split(mx.random.key(rows * 1000 + positions), 3)
    return (
        mx.random.normal((batch, heads, rows, dim), key=k1),
        mx.random.normal((batch, kv_heads, positions, dim), key=k2),
        mx.random.normal((batch, kv_heads, positions, dim), key=k3),
    )


@pytest.mark.parametrize("rows,positions", [(8, 8), (40, 100), (300, 300), (700, 1500)])
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_attention_equals_mlx(rows, positions, mask, monkeypatch):
    monkeypatch.setattr(cpu_exp, "BLOCK_SCORES", 1 << 14)  # many blocks even for the small cases
    q, k, v = _qkv(rows, positions)
    scale = 64**-0.5
    if mask == "none":
        m = None
    elif mask == "causal":
        m = "causal"
    else:  # row 1 left-padded by 5: its first query rows (when they are all prompt) see nothing
        start = mx.array([0, 5])[:, None, None, None]
        seen = mx.arange(positions)[None, None, None, :]
        m = (seen >= start) & (seen <= mx.arange(positions - rows, positions)[None, None, :, None])
    ours = cpu_exp.attention(q, k, v, scale, m)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m)
    assert mx.all(mx.isfinite(ours)).item()
    if mask == "padding":  # rows with nothing to attend to are don't-cares (mlx gives NaN or noise)
        live = mx.any(m, axis=-1, keepdims=True)
        ours, ref = mx.where(live, ours, 0.0), mx.where(live, ref, 0.0)
    assert mx.max(mx.abs(ours - ref)).item() < 2e-5


def test_single_query_rows_go_to_mlx():
    """A decode step (one query row) keeps mlx's attention: the softmax is too small to matter."""
    calls = []

    def fallback(q, k, v, cache, scale, mask, sinks=None):
        calls.append(q.shape[2])
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    sdpa = cpu_exp.sdpa_with(fallback)
    for rows in (1, 4, 8, 64):
        q, k, v = _qkv(rows, 64)
        sdpa(q, k, v, cache=None, scale=0.125, mask="causal" if rows > 1 else None)
    assert calls == [1, 4]


@pytest.fixture
def installed(gguf_model, monkeypatch):
    """The bundled model's mlx-lm module with mlx's own functions (whatever an earlier scheduler in
    this process installed), and what it had put back afterwards."""
    from mlx_lm.models import activations

    model = gguf_model.model
    module = sys.modules[type(model).__module__]
    sdpa, glu = module.scaled_dot_product_attention, module.swiglu
    stock = {"scaled_dot_product_attention": getattr(sdpa, "kiln_fallback", sdpa), "swiglu": activations.swiglu if glu is cpu_exp.swiglu else glu}
    for name, fn in stock.items():
        monkeypatch.setattr(module, name, fn)
    return model, module, stock


def _greedy(model, tokens: list[int], n: int, chunk: int = 64) -> tuple[mx.array, list[int]]:
    """The last prompt position's logits after a chunked prefill, and ``n`` greedy tokens on."""
    cache = make_prompt_cache(model)
    for start in range(0, len(tokens) - 1, chunk):
        model(mx.array(tokens[start : min(start + chunk, len(tokens) - 1)])[None], cache=cache)
    logits = first = model(mx.array(tokens[-1:])[None], cache=cache)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([out[-1:]]), cache=cache)[0, -1]
    return first, out


def test_bundled_model_prefills_the_same_with_it(installed, gguf_model):
    """(A short prompt: without OpenBLAS preloaded, as in this test process, a prefill of the
    bundled model runs at ~6 GFLOP/s.)"""
    if mx.default_device() != mx.cpu:
        pytest.skip("cpu_exp is for the CPU")
    model, module, stock = installed
    words = gguf_model.tokenizer.encode("The history of the printing press begins in the fifteenth century. " * 12)[:160]
    ref_logits, ref_tokens = _greedy(model, words, 8)

    assert cpu_exp.install(model)
    assert module.scaled_dot_product_attention is not stock["scaled_dot_product_attention"]
    assert module.swiglu is cpu_exp.swiglu
    wrapped = module.scaled_dot_product_attention
    assert cpu_exp.install(model) and module.scaled_dot_product_attention is wrapped  # in use, not wrapped twice

    logits, tokens = _greedy(model, words, 8)
    assert mx.max(mx.abs(logits - ref_logits)).item() < 1e-3 * mx.max(mx.abs(ref_logits)).item()
    assert tokens == ref_tokens


def test_kiln_cpu_exp_0_keeps_mlx_exp(installed, monkeypatch):
    """``KILN_CPU_EXP=0`` (docs/configuration.md): the model keeps mlx's own functions."""
    model, module, stock = installed
    monkeypatch.setenv("KILN_CPU_EXP", "0")
    assert not cpu_exp.install(model)
    assert module.scaled_dot_product_attention is stock["scaled_dot_product_attention"]
    assert module.swiglu is stock["swiglu"]


def test_the_check_is_remembered_per_shape(installed, monkeypatch, tmp_path):
    """A start that checked these shapes before takes the stored answer instead of compiling and
    running the check again (a second of a 2-core start); an answer of "disagrees" is kept too."""
    if mx.default_device() != mx.cpu:
        pytest.skip("cpu_exp is for the CPU")
    model, module, stock = installed
    monkeypatch.setenv("KILN_NATIVE_CACHE", str(tmp_path))
    calls = []
    checked = cpu_exp._attention_agrees
    monkeypatch.setattr(cpu_exp, "_attention_agrees", lambda m: calls.append(m) or checked(m))
    assert cpu_exp.install(model) and len(calls) == 1
    for name, fn in stock.items():
        monkeypatch.setattr(module, name, fn)
    assert cpu_exp.install(model) and len(calls) == 1  # remembered, not checked again
    assert module.scaled_dot_product_attention is not stock["scaled_dot_product_attention"]

    for stored in (tmp_path / "cpu-exp").glob("*.json"):
        stored.write_text('{"agrees": false}')
    for name, fn in stock.items():
        monkeypatch.setattr(module, name, fn)
    assert not cpu_exp.install(model) and len(calls) == 1
    assert module.scaled_dot_product_attention is stock["scaled_dot_product_attention"]
