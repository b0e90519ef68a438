"""Layers that prefill from float32 weights and decode from the packed quantized ones.

On the CPU a prefill chunk is a wide matmul that OpenBLAS runs fastest in float32, while a
decode step multiplies 1..8 rows and is bound by reading the weights: there the native kernel
(kiln/worker/native) reading the 4- or 8-bit weights as stored wins by several times. So a
quantized layer keeps both: the dense float32 weight mlx uses as an nn.Linear, and the
packed weights, scales and biases as numpy arrays (not mlx parameters, so nothing in mlx sees
them twice). Both compute the same function: the kernel dequantizes exactly as mx.dequantize
does, and only the order of the float32 sums differs.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..native.build import CpuKernels

# Inside mlx's graph each kernel call waits for mlx to evaluate its input, which costs more than
# the kernel saves beyond a few rows: a whole SmolLM2 decode step through mlx took 40 / 49 / 55 /
# 97 ms at 1 / 2 / 4 / 8 rows this way, against 67 / 76 / 80 / 83 ms from float32. (Llama-family
# models decode outside the graph instead, in one native call per step: engine/native_decode.py.)
GRAPH_MAX_ROWS = 4


class PackedWeights:
    """A quantized layer's weights as the native kernel reads them."""

    def __init__(self, module: nn.Module, kernel: CpuKernels) -> None:
        self.kernel = kernel
        self.bits: int = module.bits
        self.group_size: int = module.group_size
        self.q = np.array(module.weight).view(np.uint8)
        self.scales = np.array(module.scales.astype(mx.float16))
        self.biases = np.array(module.biases.astype(mx.float16))
        self.out_dims = self.q.shape[0]

    @staticmethod
    def supports(module: nn.Module) -> bool:
        """Affine 4/8-bit with float16-exact scales and groups the kernel's blocks divide."""
        if getattr(module, "mode", "affine") != "affine" or module.bits not in (4, 8):
            return False
        if module.group_size % 32 or module.get("biases") is None:
            return False
        return all(bool(mx.array_equal(a.astype(mx.float16).astype(a.dtype), a)) for a in (module.scales, module.biases))

    def apply(self, x: np.ndarray) -> np.ndarray:
        """x (rows, in) float32 @ W.T, rows <= kernel.max_rows."""
        return self.kernel.matmul(np.ascontiguousarray(x, dtype=np.float32), self.q, self.scales, self.biases, self.bits, self.group_size)

    def matmul(self, x: mx.array) -> mx.array | None:
        """x @ W.T through the kernel inside an mlx forward pass, or None (use the float32
        weight) for more than GRAPH_MAX_ROWS rows."""
        k = x.shape[-1]
        rows = x.size // k
        if rows > GRAPH_MAX_ROWS or x.dtype != mx.float32:
            return None
        mx.eval(x)
        return mx.array(self.apply(np.asarray(x).reshape(rows, k))).reshape(*x.shape[:-1], self.out_dims)


class PackedLinear(nn.Linear):
    """nn.Linear in float32 that decodes through its packed quantized copy."""

    def __init__(self, dense: mx.array, bias: mx.array | None, packed: PackedWeights) -> None:
        super().__init__(dense.shape[1], dense.shape[0], bias=bias is not None)
        self.weight = dense
        if bias is not None:
            self.bias = bias
        self._packed = packed

    def __call__(self, x: mx.array) -> mx.array:
        y = self._packed.matmul(x)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y


class PackedEmbedding(nn.Embedding):
    """nn.Embedding in float32 whose use as a tied output head decodes through the packed copy."""

    def __init__(self, dense: mx.array, packed: PackedWeights) -> None:
        super().__init__(dense.shape[0], dense.shape[1])
        self.weight = dense
        self._packed = packed

    def as_linear(self, x: mx.array) -> mx.array:
        y = self._packed.matmul(x)
        return super().as_linear(x) if y is None else y  # type: ignore[no-untyped-call]  # mlx's as_linear is unannotated
