"""Read a GGUF file's tensors and metadata into mlx arrays, whatever its quantization.

`mx.load` reads F32/F16 and the Q4_0/Q4_1/Q8_0 block formats straight into mlx's
affine quantized layout (packed uint32 + per-32 scales/biases), which is the fast
path and what the bundled model takes. It cannot read the K-quants (Q4_K, Q5_K,
Q6_K, ...) that most downloaded GGUFs use (Q4_K_M mixes Q4_K and Q6_K), and it fails
the whole file on one such tensor. So the types are looked at first (cheaply,
`gguf_header` reads only the header), and a file with any type mlx cannot read is read
through numpy instead: each tensor is repacked into mlx's affine layout where its type
has an exact match, else dequantized (`gguf_quants` says which type becomes what, and
how exactly); what each type became is reported so that the load can say it.

A tensor type neither path knows fails the load with the tensor's and type's name.
"""

from __future__ import annotations

import mmap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

from . import gguf_quants
from .gguf_header import GGUFHeader, TensorInfo, read_header


class UnsupportedTensorError(ValueError):
    """A tensor is stored in a GGML type this loader cannot read."""


# Types mx.load reads itself (the last three into mlx's affine 4/8-bit layout, as
# gguf_quants.repack would).
MX_NATIVE_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})
SUPPORTED_TYPES = gguf_quants.SUPPORTED


@dataclass
class GGUFContents:
    """What a GGUF holds, as the model builder needs it."""

    tensors: dict[str, mx.array]
    metadata: dict[str, Any]
    types: Counter[str] = field(default_factory=Counter)  # GGML type name -> tensor count
    # Matrices kept as the file's blocks (GGUF name -> type name, (rows, row bytes) uint8 view of
    # the memory-mapped file, weights per row); see ggml_blocks.py.
    blocks: dict[str, tuple[str, np.ndarray, int]] = field(default_factory=dict)

    def _became(self, name: str, detailed: bool = False) -> str:
        kept = sum(1 for t, _, _ in self.blocks.values() if t == name)
        if kept and kept == self.types[name]:
            return "GGUF blocks (memory-mapped, native kernels)" if detailed else "GGUF blocks"
        layout = gguf_quants.layout(name)
        return (layout.describe() if detailed else layout.became) + (f"; {kept} kept as GGUF blocks" if kept else "")

    @property
    def conversions(self) -> dict[str, str]:
        """Stored quantized type -> what it became, e.g. {"Q4_K": "affine 4-bit g32", "Q6_K": "float16"}."""
        return {name: self._became(name) for name in sorted(self.types) if name not in gguf_quants.DENSE}

    def describe(self) -> str:
        """One line for the load log, e.g. 'F32 x 29, Q4_K x 70 -> affine 4-bit g32 (scales and
        mins rounded to float16), Q6_K x 15 -> float16 (dequantized: ...)'."""
        parts = []
        for name, count in sorted(self.types.items()):
            parts.append(f"{name} x {count}" + ("" if name in gguf_quants.DENSE else f" -> {self._became(name, detailed=True)}"))
        return ", ".join(parts)


def _metadata(header: GGUFHeader) -> dict[str, Any]:
    """The key/value pairs in the shapes `mx.load(return_metadata=True)` gives them."""
    return {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in header.metadata.items()}


def ggml_type_name(type_id: int) -> str:
    """gguf's name of a GGML type id ("Q4_K"), or "#<id>" for one it does not know."""
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


def read_gguf(path: str | Path, keep: frozenset[str] = frozenset(), header: GGUFHeader | None = None) -> GGUFContents:
    """Tensors (by GGUF name) and metadata of the file at `path`; matrices of the types in
    `keep` stay the file's blocks (`GGUFContents.blocks`, views of the mapped file) instead.
    `header`: the file's header where the caller has parsed it already (not parsed twice).

    Raises UnsupportedTensorError naming the first tensor of an unknown type, and
    ValueError for a file that is not GGUF.
    """
    path = Path(path)
    try:
        header = header if header is not None else read_header(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read GGUF {path}: {exc}") from exc
    types: Counter[str] = Counter()
    names: dict[str, str] = {}
    for info in header.tensors:
        name = ggml_type_name(info.type_id)
        if name not in SUPPORTED_TYPES:
            raise UnsupportedTensorError(
                f"{path.name}: tensor {info.name!r} has GGML type {name}, which Kiln "
                f"cannot load (supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        types[name] += 1
        names[info.name] = name

    if set(types) <= MX_NATIVE_TYPES and not keep & set(types):
        try:
            # With return_metadata, mx.load returns (tensors, metadata); its stub names every form.
            loaded = cast("tuple[dict[str, mx.array], dict[str, Any]]", mx.load(str(path), return_metadata=True))
        except Exception as exc:
            raise ValueError(f"cannot read GGUF {path}: {exc}") from exc
        return GGUFContents(dict(loaded[0]), dict(loaded[1]), types)

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: dict[str, mx.array] = {}
    blocks: dict[str, tuple[str, np.ndarray, int]] = {}
    for info in header.tensors:
        type_name = names[info.name]
        data = _raw(mapped, info, type_name)
        if type_name in keep and len(info.shape) == 2:
            blocks[info.name] = (type_name, data, int(info.shape[-1]))
        elif type_name in gguf_quants.AFFINE:  # mlx's quantized triple, named as mx.load names it
            base = info.name[: -len(".weight")] if info.name.endswith(".weight") else info.name
            tensors.update({f"{base}.{part}": array for part, array in gguf_quants.repack(data, type_name).items()})
        else:
            tensors[info.name] = gguf_quants.dense(data, type_name)
    del mapped  # the kept blocks hold the mapping open
    return GGUFContents(tensors, _metadata(header), types, blocks)


def release_pages(view: np.ndarray) -> None:
    """Let go of the pages of a view of a mapped GGUF (read_gguf's blocks) that nothing reads any
    more: a matrix read once into panels (ggml_blocks.GGMLWeights) would otherwise keep the
    file's copy resident beside them. The mapping is read-only and file-backed, so a page read
    again later comes back from the file. Anything that is not such a view is left alone."""
    root, base = view, view.base
    while isinstance(base, np.ndarray):  # views of views, down to the np.memmap over the mmap
        root, base = base, base.base
    if not isinstance(base, mmap.mmap):
        return
    start = view.ctypes.data - root.ctypes.data + int(getattr(root, "offset", 0)) % mmap.ALLOCATIONGRANULARITY
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        base.madvise(mmap.MADV_DONTNEED, first, end - first)

