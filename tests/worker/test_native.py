"""The native CPU kernel multiplies exactly what mlx's dequantize gives, for every shape it takes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kiln.worker.native import cpu_kernels


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

    from kiln.worker import native
    from kiln.worker.loading.device import dequantize_modules

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


@pytest.mark.parametrize("scale", [0.125, 4.0])
def test_attention_matches_softmax_over_the_cache_views(kernel, scale):
    """One-token attention read in place from (B, KVH, capacity, D) buffers sliced to S keys,
    rows left-padded by different amounts, query heads grouped over key/value heads. A large
    scale drives most exponentials toward underflow."""
    rng = np.random.default_rng(7)
    rows, heads, kv_heads, dims, keys_len, capacity = 5, 6, 2, 64, 37, 64
    buffers = rng.standard_normal((2, rows, kv_heads, capacity, dims)).astype(np.float32)
    keys, values = buffers[0][:, :, :keys_len], buffers[1][:, :, :keys_len]
    q = rng.standard_normal((rows, heads, dims)).astype(np.float32)
    start = np.array([0, 3, 10, 36, 1], dtype=np.int32)
    out = kernel.attention(q, keys, values, start, scale)
    # Views whose keys are not contiguous runs are copied first, with the same result.
    strided = kernel.attention(q, keys.transpose(0, 1, 3, 2).copy().transpose(0, 1, 3, 2), values, start, scale)
    np.testing.assert_array_equal(strided, out)
    group = heads // kv_heads
    for b in range(rows):
        for h in range(heads):
            k, v = keys[b, h // group, start[b]:], values[b, h // group, start[b]:]
            s = (k @ q[b, h]).astype(np.float64) * scale
            w = np.exp(s - s.max())
            np.testing.assert_allclose(out[b, h], (w / w.sum()) @ v, rtol=1e-5, atol=1e-5)
