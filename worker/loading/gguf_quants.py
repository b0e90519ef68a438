"""GGML's block formats as mlx arrays: repacked into mlx's affine layout where one matches exactly.

mlx's affine quantization stores, per group of `group_size` consecutive weights of a row, a
scale and a bias, and the weights as unsigned `bits`-bit integers packed little-endian into
uint32 words: w = scale * q + bias. mlx's quantized matmul takes groups of 32, 64 or 128 and
2-8 bits. So a GGML type whose blocks are affine over 32 weights repacks without touching a
value:

| type | per 32 weights | becomes |
| --- | --- | --- |
| Q4_0 | w = d * (q - 8) | 4-bit, scale d, bias -8 d |
| Q4_1 | w = d * q + m | 4-bit, scale d, bias m |
| Q5_0 | w = d * (q - 16) | 5-bit, scale d, bias -16 d |
| Q5_1 | w = d * q + m | 5-bit, scale d, bias m |
| Q8_0 | w = d * q, q signed | 8-bit, scale d, bias -128 d (q + 128) |
| Q4_K | w = d sc q - dmin m (256-weight super-blocks of 8 groups, 6-bit sc and m) | 4-bit |
| Q5_K | as Q4_K with 5-bit q | 5-bit |

d, m and dmin are float16 in GGML, and mlx keeps its scales and biases in float16 too, so the
first five are bit-exact. For Q4_K/Q5_K the group's scale d * sc and bias -dmin * m are
products of a float16 and a 6-bit integer, up to 17 significant bits: rounded to float16
(11), each is within 2^-11 of itself relatively (2^-25 absolutely below float16's normal
range), so a weight is within 2^-11 * (q |d sc| + |dmin m|) of llama.cpp's value, a few
thousandths of one quantization step. Float16 rather than float32 scales keeps mlx's usual
layout: the GPU computes in float16 as with any mlx-community model, and the CPU worker's
native kernel (packed.py), which reads float16 scales, takes Q4_K layers as they are.

Q6_K, Q3_K and Q2_K use groups of 16, and IQ4_NL/IQ4_XS 16 non-linear levels, which mlx cannot
multiply: they are dequantized with gguf-py's reference code to float16, which holds Q6_K's d * sc * (q - 32) to float16 rounding
(the same bound). BF16 stays bfloat16 (exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

GROUP = 32  # weights per mlx group for every repacked type
_CHUNK = 1 << 22  # weights repacked per numpy pass, to bound the temporary arrays

Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]  # q (uint8), scales, biases (float16)


@dataclass(frozen=True)
class Layout:
    """What one GGML type becomes in mlx, said at load."""

    became: str  # e.g. "affine 4-bit g32", "float16"
    note: str = ""  # how close, where not bit-exact

    def describe(self) -> str:
        return f"{self.became} ({self.note})" if self.note else self.became


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block."""
    return np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5 blocks: low nibbles are weights 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of the block's little-endian uint32 is weight j's fifth bit."""
    word = np.ascontiguousarray(qh).view(np.uint32)  # (..., 1)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> Unpacked:
    d = _f16(b, 0)
    return _nibbles(b[..., 2:18]), d, d * np.float16(-8)


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[..., 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> Unpacked:
    d = _f16(b, 0)
    return _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4), d, d * np.float16(-16)


def _q5_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Unpacked:
    d = _f16(b, 0)
    q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, d * np.float16(-128)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in a Q4_K/Q5_K super-block's 12 bytes: groups 0-3
    in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7 in the nibbles of bytes
    8-11 with their top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: each 32 bytes hold two groups, the first in the low nibbles."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _k_affine(b: np.ndarray, q: np.ndarray) -> Unpacked:
    """A super-block's 8 groups: scale d * sc, bias -dmin * m, computed in float32 as llama.cpp
    does and rounded once to float16."""
    sc, mn = _k_scales(b[..., 4:16])
    d = _f16(b, 0).astype(np.float32)[..., None]
    dmin = _f16(b, 2).astype(np.float32)[..., None]
    scales = (d * sc).astype(np.float16)
    biases = (-(dmin * mn)).astype(np.float16)
    lead = b.shape[:-1]
    return q.reshape(*lead, 256), scales.reshape(*lead, 8), biases.reshape(*lead, 8)


def _q4_k(b: np.ndarray) -> Unpacked:
    return _k_affine(b, _k_low_nibbles(b[..., 16:144]))


def _q5_k(b: np.ndarray) -> Unpacked:
    qh = b[..., 16:48]  # bit i of byte k: group i, weight k
    high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).astype(np.uint8)
    return _k_affine(b, _k_low_nibbles(b[..., 48:176]) | (high << 4))


@dataclass(frozen=True)
class _Affine:
    bits: int
    block_bytes: int
    block_weights: int
    unpack: Callable[[np.ndarray], Unpacked]
    note: str = ""


_K_NOTE = "scales and mins rounded to float16"
AFFINE: dict[str, _Affine] = {
    "Q4_0": _Affine(4, 18, 32, _q4_0),
    "Q4_1": _Affine(4, 20, 32, _q4_1),
    "Q5_0": _Affine(5, 22, 32, _q5_0),
    "Q5_1": _Affine(5, 24, 32, _q5_1),
    "Q8_0": _Affine(8, 34, 32, _q8_0),
    "Q4_K": _Affine(4, 144, 256, _q4_k, _K_NOTE),
    "Q5_K": _Affine(5, 176, 256, _q5_k, _K_NOTE),
}
# No mlx layout (groups of 16): dequantized by gguf-py to float16.
DEQUANTIZED = frozenset({"Q6_K", "Q3_K", "Q2_K"})
# No mlx layout either (16 non-linear levels): dequantized by gguf-py to float16 too, where the
# CPU worker does not keep them as blocks (ggml_blocks.py).
NONLINEAR = frozenset({"IQ4_NL", "IQ4_XS"})
DENSE = frozenset({"F32", "F16", "BF16"})
SUPPORTED = frozenset(AFFINE) | DEQUANTIZED | NONLINEAR | DENSE


def layout(type_name: str) -> Layout:
    """What `type_name` tensors become (for the load log and the model's info)."""
    if type_name in AFFINE:
        spec = AFFINE[type_name]
        return Layout(f"affine {spec.bits}-bit g{GROUP}", spec.note)
    if type_name in DEQUANTIZED:
        return Layout("float16", "dequantized: mlx has no 16-weight groups")
    if type_name in NONLINEAR:
        return Layout("float16", "dequantized: mlx has no non-linear levels")
    return Layout({"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[type_name])


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned `bits`-bit integers (last axis a multiple of 32) as mlx packs them: a
    little-endian bit stream per row, read as uint32 words."""
    if bits == 8:
        packed = q.astype(np.uint8, copy=False)
    elif bits == 4:
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    else:  # 8 weights fill `bits` bytes exactly
        octets = q.reshape(*q.shape[:-1], -1, 8).astype(np.uint64)
        word = np.zeros(octets.shape[:-1], np.uint64)
        for k in range(8):
            word |= octets[..., k] << np.uint64(bits * k)
        packed = word[..., None].view(np.uint8)[..., :bits]
    return np.ascontiguousarray(packed).reshape(*q.shape[:-1], -1).view(np.uint32)


def repack(data: np.ndarray, type_name: str) -> dict[str, mx.array]:
    """A tensor's GGML blocks (rows x row bytes, uint8) as mlx's weight/scales/biases triple."""
    spec = AFFINE[type_name]
    rows = data.shape[:-1]
    flat = data.reshape(-1, data.shape[-1])
    width = flat.shape[1] // spec.block_bytes * spec.block_weights
    n = flat.shape[0]
    weight = np.empty((n, width * spec.bits // 32), np.uint32)
    scales = np.empty((n, width // GROUP), np.float16)
    biases = np.empty_like(scales)
    step = max(1, _CHUNK // max(width, 1))
    for start in range(0, n, step):
        part = flat[start : start + step]
        blocks = part.reshape(part.shape[0], -1, spec.block_bytes)
        q, s, b = spec.unpack(blocks)
        weight[start : start + step] = pack(q.reshape(part.shape[0], width), spec.bits)
        scales[start : start + step] = s.reshape(part.shape[0], -1)
        biases[start : start + step] = b.reshape(part.shape[0], -1)

    def shape(a: np.ndarray) -> np.ndarray:
        return a.reshape(*rows, a.shape[-1])

    return {"weight": mx.array(shape(weight)), "scales": mx.array(shape(scales)), "biases": mx.array(shape(biases))}


def dense(data: np.ndarray, type_name: str) -> mx.array:
    """A tensor of a type without an mlx quantized layout, as the dense dtype `layout` names."""
    if type_name == "F32":
        return mx.array(data.astype(np.float32, copy=False))
    if type_name == "F16":
        return mx.array(data.astype(np.float16, copy=False))
    if type_name == "BF16":
        return mx.array(np.ascontiguousarray(data).view(np.uint16)).view(mx.bfloat16)
    from gguf import GGMLQuantizationType, quants

    return mx.array(quants.dequantize(data, GGMLQuantizationType[type_name]).astype(np.float16))
