"""Read a GGUF file's tensors and metadata into mlx arrays, whatever its quantization.

`mx.load` reads F32/F16 and the Q4_0/Q4_1/Q8_0 block formats straight into mlx's
affine quantized layout (packed uint32 + per-32 scales/biases), which is the fast
path and what the bundled model takes. It cannot read the K-quants (Q4_K, Q5_K,
Q6_K, ...) that most downloaded GGUFs use (Q4_K_M mixes Q4_K and Q6_K), and it fails
the whole file on one such tensor. So the types are looked at first (cheaply,
`gguf_header` reads only the header), and a file with any type mlx cannot read is read
through `gguf` instead: Q4_0/Q4_1/Q8_0 tensors are repacked losslessly
into mlx's affine layout (as mx.load would), and every other quantized tensor is
dequantized with the reference `gguf.quants.dequantize` to float16, the nearest
dense layout mlx has; the conversion is reported so the load can say what was done.

A tensor type neither path knows fails the load with the tensor's and type's name.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .gguf_header import GGUFHeader, TensorInfo, read_header


class UnsupportedTensorError(ValueError):
    """A tensor is stored in a GGML type this loader cannot read."""


# Types mx.load reads itself (the last three into mlx's affine 4/8-bit layout).
MX_NATIVE_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})
# Types read through gguf-py and dequantized to float16 (float32 kept as is).
DEQUANTIZED_TYPES = frozenset({"BF16", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K"})
SUPPORTED_TYPES = MX_NATIVE_TYPES | DEQUANTIZED_TYPES


@dataclass
class GGUFContents:
    """What a GGUF holds, as the model builder needs it."""

    tensors: dict[str, mx.array]
    metadata: dict[str, Any]
    types: Counter = field(default_factory=Counter)  # GGML type name -> tensor count
    conversions: dict[str, str] = field(default_factory=dict)  # stored type -> what it became

    def describe(self) -> str:
        """One line for the load log: e.g. 'Q4_K x 70 -> float16, Q6_K x 15 -> float16, F32 x 29'."""
        parts = []
        for name, count in sorted(self.types.items()):
            became = self.conversions.get(name)
            parts.append(f"{name} x {count}" + (f" -> {became}" if became else ""))
        return ", ".join(parts)


def _metadata(header: GGUFHeader) -> dict[str, Any]:
    """The key/value pairs in the shapes `mx.load(return_metadata=True)` gives them."""
    return {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in header.metadata.items()}


def _type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"#{type_id}"


def _raw(mapped: np.ndarray, info: TensorInfo, type_name: str) -> np.ndarray:
    """The tensor's stored bytes (quantized) or values, shaped as gguf-py shapes them."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    *rows, width = info.shape
    row_bytes = width // block * size
    count = int(np.prod(rows, dtype=np.int64)) * row_bytes
    data = mapped[info.offset : info.offset + count]
    if type_name in ("F32", "F16"):
        return data.view(np.float32 if type_name == "F32" else np.float16).reshape(info.shape)
    return data.reshape(*rows, row_bytes)


# Bytes per 32-element block and whether it carries a minimum (Q4_1) besides its scale.
_AFFINE_BLOCKS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _affine(data: np.ndarray, type_name: str) -> dict[str, mx.array]:
    """A Q4_0/Q4_1/Q8_0 tensor repacked, losslessly, into mlx's affine layout (group 32).

    Each GGML block is w = d * q + m over 32 elements, which is mlx's scale * q + bias:
    Q8_0 stores signed q (mlx's q is unsigned: q + 128, bias -128 d), Q4_0 stores q with
    an implicit -8, Q4_1 an explicit minimum. GGML keeps a block's low nibbles for its
    first 16 elements; mlx packs consecutive elements two to a byte.
    """
    rows = data.shape[:-1]
    blocks = data.reshape(*rows, -1, _AFFINE_BLOCKS[type_name])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if type_name == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias = d * np.float16(-128)
        packed = q
    else:
        nibbles = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # elements 0..31
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        bias = blocks[..., 2:4].copy().view(np.float16)[..., 0] if type_name == "Q4_1" else d * np.float16(-8)
    weight = np.ascontiguousarray(packed.reshape(*rows, -1)).view(np.uint32)
    return {"weight": mx.array(weight), "scales": mx.array(d), "biases": mx.array(bias)}


def _tensor(data: np.ndarray, type_name: str) -> dict[str, mx.array] | mx.array:
    from gguf import GGMLQuantizationType, quants

    if type_name == "F32":
        return mx.array(data.astype(np.float32, copy=False))
    if type_name == "F16":
        return mx.array(data.astype(np.float16, copy=False))
    if type_name in _AFFINE_BLOCKS:
        return _affine(data, type_name)
    return mx.array(quants.dequantize(data, GGMLQuantizationType[type_name]).astype(np.float16))


def read_gguf(path: str | Path) -> GGUFContents:
    """Tensors (by GGUF name) and metadata of the file at `path`.

    Raises UnsupportedTensorError naming the first tensor of an unknown type, and
    ValueError for a file that is not GGUF.
    """
    path = Path(path)
    try:
        header = read_header(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read GGUF {path}: {exc}") from exc
    types: Counter = Counter()
    names: dict[str, str] = {}
    for info in header.tensors:
        type_name = _type_name(info.type_id)
        if type_name not in SUPPORTED_TYPES:
            raise UnsupportedTensorError(
                f"{path.name}: tensor {info.name!r} has GGML type {type_name}, which Kiln "
                f"cannot load (supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        types[type_name] += 1
        names[info.name] = type_name

    if set(types) <= MX_NATIVE_TYPES:
        try:
            tensors, metadata = mx.load(str(path), return_metadata=True)
        except Exception as exc:
            raise ValueError(f"cannot read GGUF {path}: {exc}") from exc
        return GGUFContents(dict(tensors), dict(metadata), types)

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: dict[str, mx.array] = {}
    for info in header.tensors:
        value = _tensor(_raw(mapped, info, names[info.name]), names[info.name])
        if isinstance(value, dict):  # mlx's quantized triple, named as mx.load names it
            base = info.name[: -len(".weight")] if info.name.endswith(".weight") else info.name
            tensors.update({f"{base}.{part}": array for part, array in value.items()})
        else:
            tensors[info.name] = value
    del mapped
    conversions = {name: "float16" for name in types if name not in MX_NATIVE_TYPES}
    return GGUFContents(tensors, _metadata(header), types, conversions)
