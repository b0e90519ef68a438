"""A GGUF's quantized matrices kept as the file's own blocks, for the CPU worker.

Why: a Q4_K_M GGUF (Q4_K plus Q6_K) used to become mlx's affine 4-bit layout and float16, and
then, on the CPU, a float32 copy of every matrix for mlx's BLAS prefill plus a packed copy for
the native decode kernels: a 669 MB 1B-shaped file took 5.3 GB. Here a matrix of a type the
native kernels read (worker/native/ggml.c: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL,
IQ4_XS: KEPT_TYPES) stays the file's bytes, memory-mapped (pages the kernel may drop and re-read, shared with the page cache, as llama.cpp
maps its files), and nothing else holds its values:

- the native whole-step pass (engine/native_decode.py) multiplies those blocks in place with
  8-bit activations;
- mlx's own forward pass (prefill chunks, the fallback, the native pass's build check) goes
  through ``GGMLLinear`` / ``GGMLEmbedding``, which compute dequantize-then-multiply in float32
  (the dequantization bit-exact with gguf-py's reference), so mlx's result is the exact
  reference the native pass is checked against: up to ``EXACT_KERNEL_MAX_ROWS`` rows in one C
  pass that dequantizes each group in registers (dequantizing every matrix into memory for a
  few rows made a pass ~40x a decode step, and the build check runs several), more rows (a long
  prompt's chunk) from dequantized pieces multiplied with BLAS. No full float copy ever exists.

The blocks are not mlx parameters: nothing in mlx sees them or copies them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..native.build import CpuKernels
from .panel_cache import PanelCache

# GGML type ids of the types the native kernels read in place (gguf's GGMLQuantizationType).
TYPE_IDS: dict[str, int] = {
    "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23,
}  # fmt: skip
# Types the CPU worker keeps as blocks: every type the kernels read. Q4_1 files (the bundled
# SmolLM2-135M is one) kept mlx's affine layout, a float32 copy for prefill and a packed copy for
# decoding until the ninth session; on their blocks (Q4_1 in panels, prompts through the GEMM) the
# bundled model decoded 1.9x as fast, prefilled a 1,040-token prompt 5.4x as fast and its worker
# held 239 MB instead of 862 (docs/performance.md, Results).
KEPT_TYPES = frozenset(TYPE_IDS)
# Floats of one dequantized piece when mlx multiplies (32 MB): what a prefill adds at most.
_PIECE_FLOATS = 1 << 23
# Rows up to which a product inside mlx's graph dequantizes in registers (reading the weights
# once per 8 rows) rather than into pieces for BLAS.
EXACT_KERNEL_MAX_ROWS = 32
# "0" keeps every matrix in the file's row layout (for measuring what panels bring).
PANELS_ENV = "KILN_NATIVE_PANELS"


def _panels_wanted() -> bool:
    return os.environ.get(PANELS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class GGMLWeights:
    """One matrix as a GGUF stores it: ``out_dims`` rows of ``in_dims`` weights in blocks.

    Where the kernels have panel loops for its type (every type the loops take: native/panels.c) the
    blocks are read once into panels of 16 rows (``read_matrices``), ``repacked`` says so, and the file's bytes are
    not read again (the loader then lets their pages go): one-row decoding multiplies 16 rows at
    a time, and every other reader gets each row back bit for bit."""

    def __init__(self, blocks: np.ndarray, type_name: str, in_dims: int, kernel: CpuKernels, panels: tuple[np.ndarray, int] | None = None, kept: bool = False) -> None:
        """`panels`: the blocks already read into panels and their type id (``read_matrices``);
        `kept`: those panels are mapped from a file of them (``panel_cache``)."""
        self.type_name = type_name
        self.type_id = TYPE_IDS[type_name]
        self.in_dims = in_dims
        self.out_dims = blocks.shape[0]
        self.kernel = kernel
        if kernel.ggml_row_bytes(self.type_id, in_dims) != blocks.shape[1]:
            raise ValueError(f"{type_name} rows of {blocks.shape[1]} bytes do not hold {in_dims} weights")
        self.repacked = panels is not None
        # Whether the matrix is a mapped file's pages (the GGUF's blocks or kept panels), which the
        # kernel may drop and read again, rather than the process's own memory.
        self.mapped = panels is None or kept
        # (out_dims, row bytes) uint8: a view of the memory-mapped file, or its panels
        self.blocks, self.type_id = panels if panels is not None else (blocks, self.type_id)

    def dequantize(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Rows (all, or those named) as float32."""
        return self.kernel.ggml_dequantize(self.blocks, self.type_id, self.in_dims, rows)

    def apply(self, x: np.ndarray) -> np.ndarray:
        """x (rows, in) @ W.T through the integer kernel (8-bit activations)."""
        return self.kernel.ggml_matmul(np.ascontiguousarray(x, dtype=np.float32), self.blocks, self.type_id, self.in_dims)

    def matmul(self, x: mx.array) -> mx.array:
        """x @ W.T in float32 inside an mlx forward pass, dequantize-then-multiply: in registers
        for a few rows, else from dequantized pieces of W, each piece's product evaluated before
        the next exists."""
        mx.eval(x)
        flat = x.reshape(-1, self.in_dims).astype(mx.float32)
        if flat.shape[0] <= EXACT_KERNEL_MAX_ROWS:
            mx.eval(flat)
            rows = np.ascontiguousarray(np.asarray(flat))
            product = self.kernel.ggml_matmul(rows, self.blocks, self.type_id, self.in_dims, exact=True)
            return mx.array(product).reshape(*x.shape[:-1], self.out_dims)
        step = max(16, _PIECE_FLOATS // self.in_dims // 16 * 16)  # whole panels
        parts: list[mx.array] = []
        for start in range(0, self.out_dims, step):
            piece = mx.array(self.kernel.ggml_dequantize(self.blocks[start : start + step], self.type_id, self.in_dims))
            part = flat @ piece.T
            mx.eval(part)
            parts.append(part)
        y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        return y.reshape(*x.shape[:-1], self.out_dims)


def read_matrices(matrices: Sequence[tuple[np.ndarray, str, int]], kernel: CpuKernels, kept: PanelCache | None = None) -> list[GGMLWeights]:
    """A ``GGMLWeights`` for each (blocks, type name, in dims), those whose type has panels read
    into them (unless ``KILN_NATIVE_PANELS=0``): mapped from `kept` where it has them, else all
    in one native call (``CpuKernels.ggml_panels_many``) and then kept there for later starts."""
    for blocks, type_name, in_dims in matrices:
        if kernel.ggml_row_bytes(TYPE_IDS[type_name], in_dims) != blocks.shape[1]:
            raise ValueError(f"{type_name} rows of {blocks.shape[1]} bytes do not hold {in_dims} weights")
    wanted = [(blocks, TYPE_IDS[type_name], in_dims) for blocks, type_name, in_dims in matrices]
    panels: Sequence[tuple[np.ndarray, int] | None] = [None] * len(matrices)
    mapped = False
    if _panels_wanted() and kernel.panels:
        found = kept.mapped(wanted, kernel) if kept is not None else None
        mapped = found is not None
        panels = found if found is not None else kernel.ggml_panels_many(wanted)
        if kept is not None and not mapped:
            kept.keep(wanted, panels)
    return [GGMLWeights(blocks, type_name, in_dims, kernel, read, mapped) for (blocks, type_name, in_dims), read in zip(matrices, panels, strict=True)]


class GGMLLinear(nn.Module):
    """nn.Linear over a GGUF's blocks (see the module docstring)."""

    def __init__(self, weights: GGMLWeights, bias: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        self._ggml = weights
        if bias:
            self.bias = mx.zeros((weights.out_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        y = self._ggml.matmul(x)
        return y + self.bias if "bias" in self else y


class GGMLEmbedding(nn.Module):
    """nn.Embedding over a GGUF's blocks: a lookup dequantizes only the rows it reads."""

    def __init__(self, weights: GGMLWeights) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        self._ggml = weights
        self.num_embeddings = weights.out_dims
        self.dims = weights.in_dims

    def __call__(self, ids: mx.array) -> mx.array:
        mx.eval(ids)
        rows = self._ggml.dequantize(np.asarray(ids).reshape(-1))
        return mx.array(rows).reshape(*ids.shape, self.dims)

    def as_linear(self, x: mx.array) -> mx.array:
        return self._ggml.matmul(x)


def ggml_weights(module: nn.Module) -> GGMLWeights | None:
    """The blocks behind a GGMLLinear or GGMLEmbedding, else None."""
    return module._ggml if type(module) in (GGMLLinear, GGMLEmbedding) else None
