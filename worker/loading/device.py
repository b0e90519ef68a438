"""Choose the in-memory weight format for the device the worker runs on.

On Metal and CUDA mlx's quantized matmuls are fast and save memory, so the
weights stay as stored ("native"). On the CPU they are several times slower
than a dense BLAS matmul, so by default we dequantize to a dense dtype there.
Measured on the x86-64 dev machine with OpenBLAS preloaded (SmolLM2-135M,
228-token prompt, tokens per CPU-second, one BLAS thread): float32 prefills
at ~110 and decodes at ~5; float16 ~7 / ~1.3, bfloat16 ~12 / ~3.4, native
4-bit ~8 / ~4. mlx's half-precision CPU matmuls do not go through BLAS, so
float32 is the CPU default. bfloat16 also computes visibly less accurately on
the CPU (greedy output of SmolLM2 drifts), so it is for experiments only.
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..native.build import CpuKernels, cpu_kernels
from .packed import PackedEmbedding, PackedLinear, PackedWeights
from .parameters import flat_parameters

WeightsChoice = Literal["auto", "native", "float32", "float16", "bfloat16"]
WEIGHTS_CHOICES: tuple[str, ...] = ("auto", "native", "float32", "float16", "bfloat16")

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# What "auto" means on the CPU; see the module docstring for why.
CPU_AUTO_DTYPE = "float32"


def on_cpu() -> bool:
    """True when mlx computes on the CPU (no Metal/CUDA device selected)."""
    return mx.default_device().type == mx.DeviceType.cpu


def resolve_weights(choice: str) -> str:
    """Turn the user's choice into "native" or a dtype name for this device."""
    if choice not in WEIGHTS_CHOICES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS_CHOICES)}; got {choice!r}")
    if choice == "auto":
        return CPU_AUTO_DTYPE if on_cpu() else "native"
    return choice


def keeps_gguf_blocks(choice: str) -> bool:
    """Whether a GGUF's quantized matrices (of ggml_blocks.KEPT_TYPES) stay the file's blocks: with
    "auto" on the CPU where the native kernels are built, as the packed copies below are kept."""
    return choice == "auto" and on_cpu() and cpu_kernels() is not None


def dequantize_modules(model: nn.Module, dtype: mx.Dtype, kernel: CpuKernels | None = None) -> int:
    """Replace QuantizedLinear/QuantizedEmbedding by dense layers in `dtype`.

    Returns the number of modules replaced. Biases of linear layers and all
    other parameters (norms) are cast to `dtype` too, so the model computes in
    one precision. With a native `kernel` (float32 only), layers it supports keep
    their packed weights for decoding (see packed.py).
    """
    replaced: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        dense = _dequantized(module).astype(dtype)
        packed = None
        layer: nn.Module
        if kernel is not None and dtype == mx.float32 and PackedWeights.supports(module):
            packed = PackedWeights(module, kernel)
        if isinstance(module, nn.QuantizedLinear):
            bias = module.bias.astype(dtype) if "bias" in module else None
            if packed is not None:
                layer = PackedLinear(dense, bias, packed)
            else:
                layer = nn.Linear(dense.shape[1], dense.shape[0], bias=bias is not None)
                layer.weight = dense
                if bias is not None:
                    layer.bias = bias
        elif packed is not None:
            layer = PackedEmbedding(dense, packed)
        else:
            layer = nn.Embedding(dense.shape[0], dense.shape[1])
            layer.weight = dense
        replaced.append((name, layer))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    cast_floating(model, dtype)
    return len(replaced)


def cast_floating(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast every floating-point parameter to `dtype` (packed ints stay as they are)."""
    params = flat_parameters(model)
    model.update(
        tree_unflatten(
            [(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in params]
        )
    )


def _dequantized(module: nn.Module) -> mx.array:
    # float32 scales/biases: exact dense values, and mlx's CPU kernel runs
    # about 3x faster in float32 than in the stored float16.
    biases = module.biases
    return mx.dequantize(
        module.weight,
        module.scales.astype(mx.float32),
        None if biases is None else biases.astype(mx.float32),
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
    )


def prepare_weights(model: nn.Module, choice: str = "auto") -> str:
    """Apply the weight format `choice` to `model` in place; return what was applied.

    "native" keeps the stored layout (quantized stays quantized). A dtype
    dequantizes quantized layers and casts the rest. The float dtypes also
    apply to an unquantized model (e.g. bfloat16 folder weights -> float32).
    """
    resolved = resolve_weights(choice)
    if resolved != "native":
        # "auto" on the CPU also keeps the packed weights for the native decode kernel.
        kernel = cpu_kernels() if choice == "auto" and on_cpu() else None
        dequantize_modules(model, _DTYPES[resolved], kernel)
        mx.eval(model.parameters())
    return resolved
