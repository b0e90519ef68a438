"""decode.c's structs, mirrored for ctypes: a model's weights as its forward pass reads them.

Why a module of its own: the layout must match the C declarations field for field, and one
place to compare them with is easier to keep right than fields spread over the caller. The
structs hold raw pointers, so each keeps the numpy arrays it points into (``_keep``): a struct
never outlives the memory it names.
"""

from __future__ import annotations

import ctypes
from typing import overload

import numpy as np

_p = ctypes.c_void_p


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


class QuantizedWeights(ctypes.Structure):
    """kiln_qw: one packed matrix (mlx's affine 4- or 8-bit layout, or a GGUF's blocks of GGML
    type ``type``), and an optional bias."""

    _fields_ = [("q", _p), ("s", _p), ("b", _p), ("bias", _p), ("bits", ctypes.c_int), ("gs", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int), ("type", ctypes.c_int)]

    @classmethod
    def of(cls, q: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int, bias: np.ndarray | None = None) -> QuantizedWeights:
        arrays: list[np.ndarray] = [np.ascontiguousarray(q, np.uint8), np.ascontiguousarray(scales, np.float16), np.ascontiguousarray(biases, np.float16)]
        if bias is not None:
            bias = np.ascontiguousarray(bias, np.float32)
        out = cls(*(_ptr(a) for a in arrays), _ptr(bias), bits, group_size, q.shape[0], q.shape[1] * 8 // bits)
        out._keep = (arrays, bias)
        return out

    @classmethod
    def of_blocks(cls, blocks: np.ndarray, type_id: int, in_dims: int, bias: np.ndarray | None = None) -> QuantizedWeights:
        """A GGUF matrix's blocks ((rows, row bytes) uint8, read in place: never copied)."""
        if not blocks.flags.c_contiguous:
            raise ValueError("GGUF blocks must be one contiguous run of rows")
        if bias is not None:
            bias = np.ascontiguousarray(bias, np.float32)
        out = cls(_ptr(blocks), None, None, _ptr(bias), 0, 0, blocks.shape[0], in_dims, type_id)
        out._keep = (blocks, bias)
        return out


class Layer(ctypes.Structure):
    """kiln_layer: one decoder block."""

    _fields_ = [("attn_norm", _p), ("mlp_norm", _p), ("q_norm", _p), ("k_norm", _p)] + [
        (name, QuantizedWeights) for name in ("q", "k", "v", "o", "gate", "up", "down")
    ]


class Model(ctypes.Structure):
    """kiln_model: the whole decoder."""

    _fields_ = [
        *((name, ctypes.c_int) for name in ("n_layers", "hidden", "inter", "heads", "kv_heads", "head_dim", "vocab", "rope_traditional")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("inv_freq", _p),
        ("embedding", _p),
        ("final_norm", _p),
        ("head", QuantizedWeights),
        ("layers", ctypes.POINTER(Layer)),
        ("embed_q", QuantizedWeights),  # the embedding's GGUF blocks where `embedding` is NULL
    ]


# kiln_cache: keys, values (char *), the row and head strides of each in bytes, and the kind
# (decode.c KILN_KV_FLOAT32 or KILN_KV_INT8; engine/kv_int8.py).
CACHE_FIELDS = 7


@overload
def floats(a: np.ndarray) -> np.ndarray: ...
@overload
def floats(a: None) -> None: ...
@overload
def floats(a: np.ndarray | None) -> np.ndarray | None: ...
def floats(a: np.ndarray | None) -> np.ndarray | None:
    """A float32 C-contiguous copy (or the array itself when it already is one)."""
    return None if a is None else np.ascontiguousarray(a, np.float32)
