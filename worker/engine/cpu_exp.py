"""The exp-bound parts of mlx-lm's models on the CPU: attention's softmax and the MLP's SiLU.

Why: mlx's CPU ``exp`` is scalar and slow. On the dev machine (mlx 0.32, Zen 4) ``mx.exp`` of
512x1536 floats took 7.7 ms where numpy's took 0.3 ms and an ``mx.multiply`` 0.09 ms, so a
prompt's prefill spent most of its time there: at 512 tokens a SmolLM2 layer's SiLU cost ~13 ms
and its causal attention ~27 ms (``mx.fast.scaled_dot_product_attention``, which on the CPU
falls back to a softmax over the full score matrix).

What: ``exp`` here is 2^(x log2 e) split into an integer power (built in the float's exponent
bits) and a degree-6 polynomial for the fraction, all in mlx ops that vectorize, compiled (the
bit cast apart): relative error ~1e-7 (float32's own rounding) for ~1.9 ms on the same array.
``attention`` is the reference softmax(QK^T) V with that exp, computing scores in the inputs'
dtype and the softmax in float32 as mlx's own fallback does; ``swiglu`` is silu(gate) * x.

How it is used: ``install`` puts both into the module of a mlx-lm model (the names its
attention and MLP call: ``scaled_dot_product_attention`` and ``swiglu``), on the CPU only, and
only after a check on the model's own shapes shows they agree with mlx's to float32 accuracy;
otherwise the model keeps mlx's. What the fast path does not cover (a quantized KV cache,
attention sinks, fewer than MIN_ROWS query rows, as in a decode step, where the softmax is too
small to matter) goes to the function it replaced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ..loading.parameters import flat_parameters
from ..native.kept import KeptJson
from .layout import on_cpu

log = logging.getLogger("kiln.worker.engine")

# "0" keeps mlx's own exp everywhere (docs/configuration.md).
ENABLE_ENV = "KILN_CPU_EXP"
# Below this many query rows (a decode step) the softmax is small: mlx's own path is kept.
MIN_ROWS = 8
# Scores per block of query rows (see ``attention``): ~4 MB of float32.
BLOCK_SCORES = 1 << 20

# A masked score: finite, so that a row with nothing to attend to (a padding row) averages
# instead of dividing 0 by 0; far enough below any real score that its weight is 0.
_MASKED = mx.array(-1e30, mx.float32)
_LOG2E = 1.4426950408889634
# 2^f for f in [-0.5, 0.5]: a minimax polynomial, highest degree first.
_EXP2 = (1.5353362e-4, 1.3398874e-3, 9.6180009e-3, 5.5503338e-2, 2.4022650e-1, 6.9314718e-1, 1.0)


@partial(mx.compile, shapeless=True)
def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """2^f by the polynomial and the bits of 2^n, for e^x = 2^(n + f)."""
    z = mx.clip(x, -87.0, 88.0) * _LOG2E
    n = mx.floor(z + 0.5)
    f = z - n
    p = mx.array(_EXP2[0], mx.float32)
    for c in _EXP2[1:]:
        p = p * f + c
    return p, (n.astype(mx.int32) + 127) << 23


def exp(x: mx.array) -> mx.array:
    """e^x in float32 for float32 ``x`` (clamped to [-87, 88]: e^-87 stands for 0).

    The bit cast stays outside the compiled part: mlx cannot compile a view shapelessly, and a
    compiled function per shape would keep one trace for every prompt length it ever saw."""
    p, bits = _exp_parts(x)
    return p * mx.view(bits, mx.float32)


@partial(mx.compile, shapeless=True)
def _silu_times(gate: mx.array, e: mx.array, x: mx.array) -> mx.array:
    return (gate / (1.0 + e) * x.astype(mx.float32)).astype(x.dtype)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, the SwiGLU of llama-style MLPs, with the exp above."""
    g = gate.astype(mx.float32)
    return _silu_times(g, exp(-g), x)


def softmax(scores: mx.array) -> mx.array:
    """softmax over the last axis of float32 scores."""
    e = exp(scores - mx.max(scores, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """softmax(scale * Q K^T + mask) V for (B, heads, L, D) queries and (B, kv_heads, S, D) keys
    and values (grouped queries share their kv head). ``mask``: None, "causal" (the last L of
    the S positions are the queries'), a boolean array (True: attend) or an additive one.

    Rows go in blocks of about BLOCK_SCORES scores: over a whole prompt's score matrix (9 heads x
    512 x 1024 floats, 19 MB) the exp alone took ~10 ns per element against ~2.5 ns on blocks of
    about 1M, and a causal block needs only the keys up to its last row. (Blocks of 16-32 rows
    were faster for attention alone but not for a whole prefill: 3.0-3.1 s against 2.95 s for a
    1040-token prompt.)"""
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"unknown mask {mask!r}")
    b, heads, rows, _ = queries.shape
    positions = keys.shape[2]
    step = max(MIN_ROWS, BLOCK_SCORES // max(1, heads * positions) // MIN_ROWS * MIN_ROWS)
    if rows <= step:
        return _attention_block(queries, keys, values, scale, mask)
    blocks = []
    for r in range(0, rows, step):
        q = queries[:, :, r : r + step]
        if isinstance(mask, str):  # causal: the block sees positions up to its last row's
            seen = positions - rows + r + q.shape[2]
            blocks.append(_attention_block(q, keys[:, :, :seen], values[:, :, :seen], scale, mask))
        else:
            part = mask if mask is None or mask.ndim < 2 or mask.shape[-2] == 1 else mask[..., r : r + step, :]
            blocks.append(_attention_block(q, keys, values, scale, part))
    return mx.concatenate(blocks, axis=2)


def _attention_block(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    b, heads, rows, dim = queries.shape
    kv_heads, positions = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = (queries * scale).reshape(b, kv_heads, group * rows, dim)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(b, kv_heads, group, rows, positions).astype(mx.float32)
    if isinstance(mask, str):  # causal: the queries are the last ``rows`` positions
        seen = mx.arange(positions - rows, positions)[:, None] >= mx.arange(positions)[None, :]
        scores = mx.where(seen, scores, _MASKED)
    elif mask is not None:
        mask = _grouped(mask, kv_heads, group)
        scores = mx.where(mask, scores, _MASKED) if mask.dtype == mx.bool_ else scores + mask.astype(mx.float32)
    weights = softmax(scores).astype(values.dtype).reshape(b, kv_heads, group * rows, positions)
    return (weights @ values).reshape(b, heads, rows, dim)


def _grouped(mask: mx.array, kv_heads: int, group: int) -> mx.array:
    """A mask broadcastable to (B, heads, L, S) as one broadcastable to (B, kv_heads, group, L, S)."""
    while mask.ndim < 4:
        mask = mx.expand_dims(mask, 0)
    if mask.shape[1] == 1:
        return mx.expand_dims(mask, 2)
    return mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[2:])


def sdpa_with(fallback: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's ``scaled_dot_product_attention`` signature over ``attention``, handing what it
    does not cover to ``fallback``."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):  # type: ignore[no-untyped-def]
        if sinks is not None or hasattr(cache, "bits") or queries.shape[2] < MIN_ROWS:
            return fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return attention(queries, keys, values, scale, mask)

    scaled_dot_product_attention.kiln_fallback = fallback  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def install(model: nn.Module) -> bool:
    """Use the fast softmax and SiLU in ``model``'s mlx-lm module if they agree with mlx's on
    the model's shapes; whether they are in use. CPU only: on a GPU mlx's kernels are fast.
    ``KILN_CPU_EXP=0`` turns it off."""
    if not on_cpu() or os.environ.get(ENABLE_ENV, "1") == "0":
        return False
    module = sys.modules.get(type(model).__module__)
    if module is None:
        return False
    sdpa = getattr(module, "scaled_dot_product_attention", None)
    glu = getattr(module, "swiglu", None)
    done, using = [], False
    if sdpa is not None:
        if hasattr(sdpa, "kiln_fallback"):  # installed by an earlier model of this module
            using = True
        elif _remembered(("attention", *_attention_shape(model)), lambda: _attention_agrees(model)):
            module.scaled_dot_product_attention = sdpa_with(sdpa)  # type: ignore[attr-defined]
            done.append("attention")
    if glu is not None:
        if glu is swiglu:
            using = True
        elif _remembered(("swiglu",), lambda: _swiglu_agrees(glu)):
            module.swiglu = swiglu  # type: ignore[attr-defined]
            done.append("swiglu")
    if done:
        log.info("cpu exp: polynomial exp in %s of %s", " and ".join(done), module.__name__)
    return using or bool(done)


def _close(ours: mx.array, ref: mx.array) -> bool:
    ours, ref = ours.astype(mx.float32), ref.astype(mx.float32)
    # .item() of a float32 scalar is a float (its stub also names int and complex).
    err = cast(float, mx.max(mx.abs(ours - ref)).item())
    return bool(mx.all(mx.isfinite(ours)).item()) and err <= 1e-4 * max(1.0, cast(float, mx.max(mx.abs(ref)).item()))


def _remembered(what: tuple[object, ...], check: Callable[[], bool]) -> bool:
    """``check()``, or its result when it ran before for ``what`` with this code and this mlx.

    Why: each check compiles and runs the fast and the reference function on the model's shapes,
    ~0.2 s a mask on a 2-core machine, so most of a second of every start; the answer depends
    only on the shapes, this module and mlx. Stored as JSON beside the native kernels' cache
    (``cpu-exp/``); a store that cannot be read or written only means checking again."""
    from ..native.build import _cache_dir

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(json.dumps([*map(str, what), getattr(mx, "__version__", "-"), platform.machine()]).encode())
    kept, key = KeptJson(_cache_dir() / "cpu-exp"), digest.hexdigest()[:24]
    record = kept.get(key)
    if record is not None and isinstance(record.get("agrees"), bool):
        return bool(record["agrees"])
    agrees = check()
    kept.put(key, {"agrees": agrees, "what": [str(w) for w in what]})
    return agrees


def _attention_shape(model: nn.Module) -> tuple[object, ...]:
    """What ``_attention_agrees`` checks with: heads, key-value heads, head size and dtype."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    hidden = getattr(args, "hidden_size", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    dim = getattr(args, "head_dim", None) or (hidden // heads if heads and hidden else None)
    return heads, kv_heads, dim, _dtype(model)


def _attention_agrees(model: nn.Module) -> bool:
    heads, kv_heads, dim, dtype = _attention_shape(model)
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or not isinstance(dim, int) or not isinstance(dtype, mx.Dtype):
        return False
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        return False
    kq, kk, kv = mx.random.split(mx.random.key(7), 3)
    q = mx.random.normal((2, heads, 24, dim), key=kq).astype(dtype)
    k = mx.random.normal((2, kv_heads, 40, dim), key=kk).astype(dtype)
    v = mx.random.normal((2, kv_heads, 40, dim), key=kv).astype(dtype)
    scale = dim**-0.5
    padded = mx.arange(40)[None, None, None, :] >= mx.array([0, 5])[:, None, None, None]
    for mask in (None, "causal", padded):
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        if not _close(attention(q, k, v, scale, mask), ref):
            log.warning("cpu exp: attention disagrees with mlx's (mask %s); mlx's is kept", type(mask).__name__)
            return False
    return True


def _swiglu_agrees(glu: Callable[[mx.array, mx.array], mx.array]) -> bool:
    gate = mx.random.normal((64, 256), key=mx.random.key(8)) * 8
    x = mx.random.normal((64, 256), key=mx.random.key(9))
    if _close(swiglu(gate, x), glu(gate, x)):
        return True
    log.warning("cpu exp: swiglu disagrees with mlx's; mlx's is kept")
    return False


def _dtype(model: nn.Module) -> mx.Dtype:
    for _, value in flat_parameters(model):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32
