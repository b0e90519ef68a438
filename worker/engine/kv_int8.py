"""The 8-bit KV cache (``--kv-cache int8``): how one position is stored, and numpy's copy of it.

Why: the cache is float32 by default, 4 bytes a value: at 16 k tokens a 1B Llama's (16 layers,
8 KV heads of 64) takes 1 GB per sequence where llama.cpp's float16 takes 0.5 GB and its
``-ctk q8_0 -ctv q8_0`` 0.27 GB. Here each position of a head (its head_dim values) is stored as
int8 in blocks of 32, every block followed by its float32 scale (the block's largest magnitude
over 127): 36 bytes per 32 values, 0.28 of float32, the content of llama.cpp's q8_0 (whose
scale is a float16).

The buffers stay mlx-lm's BatchKVCache arrays, of dtype uint8 and a last axis of
``position_bytes`` instead of head_dim: the prefix cache, row extraction, merging and rollback
copy whole positions and never look inside one. Only decode.c reads them (``kv_store``,
``kv_dot_int8``, ``kv_load_int8`` there), so the 8-bit cache is only used where the native pass
runs every step of the model (native_decode.py ``NativeDecoder.kv_int8``): mlx's own attention
cannot read it.
"""

from __future__ import annotations

import numpy as np

from kiln.protocol.model_config import KVCacheType

__all__ = ["BLOCK", "FLOAT32", "INT8", "KVCacheType", "dequantize", "position_bytes", "quantize"]
# decode.c's kinds (kiln_cache.kind) and block.
FLOAT32, INT8 = 0, 1
BLOCK = 32


def position_bytes(kind: int, head_dim: int) -> int:
    """Bytes of one head's position (decode.c ``kv_position_bytes``)."""
    return head_dim + 4 * (head_dim // BLOCK) if kind == INT8 else 4 * head_dim


def quantize(values: np.ndarray) -> np.ndarray:
    """(..., head_dim) float32 -> (..., position_bytes) uint8, as decode.c's ``kv_store`` rounds
    (float32 arithmetic, ties to even): a cache mlx wrote (the build check's prefill) made 8-bit."""
    x = np.ascontiguousarray(values, np.float32)
    head_dim = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], head_dim // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse).astype(np.int8).reshape(*x.shape[:-1], head_dim)
    scales = (amax[..., 0] / np.float32(127)).astype(np.float32)
    out = np.empty((*x.shape[:-1], position_bytes(INT8, head_dim)), np.uint8)
    out[..., :head_dim] = q.view(np.uint8)
    out[..., head_dim:] = np.ascontiguousarray(scales).view(np.uint8).reshape(*x.shape[:-1], 4 * (head_dim // BLOCK))
    return out


def dequantize(stored: np.ndarray, head_dim: int) -> np.ndarray:
    """(..., position_bytes) uint8 -> (..., head_dim) float32: what the native pass reads."""
    s = np.ascontiguousarray(stored, np.uint8)
    q = s[..., :head_dim].view(np.int8).astype(np.float32)
    scales = np.ascontiguousarray(s[..., head_dim:]).view(np.float32)
    return (q.reshape(*q.shape[:-1], head_dim // BLOCK, BLOCK) * scales[..., None]).reshape(q.shape)
