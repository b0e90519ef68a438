"""Read a GGUF file's tensors and metadata into mlx arrays, whatever its quantization.

`mx.load` reads F32/F16 and the Q4_0/Q4_1/Q8_0 block formats straight into mlx's
affine quantized layout (packed uint32 + per-32 scales/biases), which is the fast
path and what the bundled model takes. It cannot read the K-quants (Q4_K, Q5_K,
Q6_K, ...) that most downloaded GGUFs use (Q4_K_M mixes Q4_K and Q6_K), and it fails
the whole file on one such tensor. So the types are looked at first (cheaply,
`gguf.GGUFReader` maps the file), and a file with any type mlx cannot read is read
through `gguf` instead: each quantized tensor is dequantized with the reference
`gguf.quants.dequantize` to float16, the nearest dense layout mlx has, and the
conversion is reported so the load can say what was done.

A tensor type neither path knows fails the load with the tensor's and type's name.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np


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


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError/struct.error/... on a bad file
        raise ValueError(f"cannot read GGUF {path}: {exc}") from exc


def _metadata(reader: Any) -> dict[str, Any]:
    """The key/value pairs in the shapes `mx.load(return_metadata=True)` gives them."""
    md: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = fld.contents()
        if isinstance(value, list) and value and not isinstance(value[0], str):
            value = mx.array(value)  # numeric arrays (token types, scores) as mx.load does
        md[name] = value
    return md


def _dequantized(tensor: Any, type_name: str) -> mx.array:
    from gguf import quants

    if type_name == "F32":
        return mx.array(np.asarray(tensor.data, dtype=np.float32))
    if type_name == "F16":
        return mx.array(np.asarray(tensor.data, dtype=np.float16))
    dense = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return mx.array(dense.astype(np.float16))


def read_gguf(path: str | Path) -> GGUFContents:
    """Tensors (by GGUF name) and metadata of the file at `path`.

    Raises UnsupportedTensorError naming the first tensor of an unknown type, and
    ValueError for a file that is not GGUF.
    """
    path = Path(path)
    reader = _reader(path)
    types: Counter = Counter()
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise UnsupportedTensorError(
                f"{path.name}: tensor {tensor.name!r} has GGML type {type_name}, which Kiln "
                f"cannot load (supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        types[type_name] += 1

    if set(types) <= MX_NATIVE_TYPES:
        del reader  # release the mapping before mlx maps the file again
        try:
            tensors, metadata = mx.load(str(path), return_metadata=True)
        except Exception as exc:
            raise ValueError(f"cannot read GGUF {path}: {exc}") from exc
        return GGUFContents(dict(tensors), dict(metadata), types)

    tensors = {t.name: _dequantized(t, t.tensor_type.name) for t in reader.tensors}
    conversions = {name: "float16" for name in types if name not in ("F32", "F16")}
    return GGUFContents(tensors, _metadata(reader), types, conversions)
