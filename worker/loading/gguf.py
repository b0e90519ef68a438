"""Load a GGUF file into the matching mlx-lm model class.

`gguf_read.read_gguf` gives the tensors (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K in
mlx's affine quantized layout, Q6_K/Q3_K/Q2_K dequantized to float16) and metadata; `gguf_arch` says which
mlx-lm class, arguments and tensor names each architecture uses. Loading is then
renaming tensors, undoing the converter's weight changes, and quantizing exactly
the modules the file stored quantized, each with the bits/group size its tensors
imply.
"""

from __future__ import annotations

import importlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .errors import UnsupportedModelError
from .ggml_blocks import KEPT_TYPES, GGMLEmbedding, GGMLLinear, read_matrices
from .gguf_arch import ARCHITECTURES, DEFAULT_CONTEXT, TOP_NAMES, Architecture, scalar
from .gguf_header import GGUFHeader, read_header
from .gguf_read import GGUFContents, UnsupportedTensorError, read_gguf, release_pages
from .gguf_vocab import UnsupportedTokenizerError
from .info import ModelInfo
from .panel_cache import PanelCache
from .tokenizer import Tokenizer

log = logging.getLogger("kiln.worker.loading")


SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

# llama.cpp `general.file_type`, for logs and the model listing.
_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S",
    15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 25: "IQ4_NL", 30: "IQ4_XS", 32: "BF16",
}  # fmt: skip

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


def _mlx_name(gguf_name: str, block_names: Mapping[str, str]) -> str | None:
    """The mlx-lm parameter name for a GGUF tensor, or None to drop it."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, part, kind = m.groups()
        target = block_names.get(part)
        return None if target is None else f"model.layers.{layer}.{target}.{kind}"
    if m := _TOP_RE.match(gguf_name):
        part, kind = m.groups()
        target = TOP_NAMES.get(part)
        return None if target is None else f"{target}.{kind}"
    return None


class FactorRoPE(nn.Module):
    """Interleaved RoPE with per-dimension frequency factors (GGUF `rope_freqs`).

    Llama-3.1-style GGUFs bake their long-context frequency scaling into a
    `rope_freqs` tensor that divides each rotation frequency; mlx takes the
    equivalent wavelengths through `mx.fast.rope(freqs=...)`. The native decode pass
    (engine/native_decode.py) rotates by the same wavelengths (``wavelengths``).
    """

    def __init__(self, dims: int, base: float, factors: mx.array) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        self.dims = dims
        exponents = mx.arange(0, dims, 2, dtype=mx.float32) / dims
        self._freqs = (base**exponents) * factors.astype(mx.float32)
        # Computed now, on the loading thread: left lazy, the engine thread would be the first to
        # evaluate it and mlx refuses ("There is no Stream(cpu, 0) in current thread"), which
        # failed every Llama 3.1/3.2 GGUF's first request.
        mx.eval(self._freqs)

    @property
    def wavelengths(self) -> mx.array:
        """(dims / 2,) float32: pair i turns by position / wavelengths[i]."""
        return self._freqs

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=True, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def _quant_params(path: str, weights: Mapping[str, mx.array], module: nn.Module) -> dict[str, Any] | bool:
    """Bits and group size of a module the file stores quantized (False if not)."""
    scales = weights.get(f"{path}.scales")
    if scales is None or not hasattr(module, "to_quantized"):
        return False
    packed = weights[f"{path}.weight"]
    in_dims = module.weight.shape[-1]
    return {
        "group_size": in_dims // scales.shape[-1],
        "bits": packed.shape[-1] * 32 // in_dims,
        "mode": "affine",
    }


def _rename(contents: GGUFContents, arch: Architecture) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for name, value in contents.tensors.items():
        target = _mlx_name(name, arch.block_names)
        if target is None:
            continue
        if arch.norm_offset and target.endswith("norm.weight"):
            value = value.astype(mx.float32) - arch.norm_offset
        weights[target] = value
    return weights


# mlx-lm modules whose every matrix the native pass (engine/native_decode.py) can read as GGUF
# blocks. Other architectures keep the converted layouts: through mlx alone, blocks would be
# dequantized afresh at every decode step.
_BLOCK_MODULES = frozenset({"llama", "qwen2", "qwen3"})


def _kept_types(header: GGUFHeader | None, keep_blocks: bool) -> frozenset[str]:
    """The GGML types to keep as the file's blocks: none unless asked, the kernels are built and the
    architecture decodes natively, else every type the kernels read. `header` None: unreadable
    (read_gguf says what is wrong with the file)."""
    if not keep_blocks or header is None:
        return frozenset()
    from ..native.build import cpu_kernels

    arch = ARCHITECTURES.get(str(header.metadata.get("general.architecture")))
    if arch is None or arch.module not in _BLOCK_MODULES or cpu_kernels() is None:
        return frozenset()
    return KEPT_TYPES


def _use_blocks(model: nn.Module, model_path: Path, contents: GGUFContents, arch: Architecture, weights: Mapping[str, mx.array]) -> None:
    """Put a GGMLLinear / GGMLEmbedding over each kept matrix's blocks where the model has its
    Linear / Embedding (before load_weights, which then loads only the rest)."""
    from ..native.build import cpu_kernels

    kernel = cpu_kernels()
    modules = dict(model.named_modules())
    replaced: list[tuple[str, nn.Module]] = []
    started, repacked = time.perf_counter(), []
    named = [(target[: -len(".weight")], name) for name in contents.blocks if (target := _mlx_name(name, arch.block_names)) is not None]
    if kernel is None or not named:
        return
    kept = PanelCache.for_file(model_path, kernel)
    read = read_matrices([(data, type_name, in_dims) for type_name, data, in_dims in (contents.blocks[name] for _, name in named)], kernel, kept)
    for (path, name), blocks in zip(named, read, strict=True):
        type_name, data, _ = contents.blocks[name]
        module = modules.get(path)
        if blocks.repacked:
            release_pages(data)
            repacked.append(blocks.blocks.nbytes)
        if isinstance(module, nn.Embedding):
            replaced.append((path, GGMLEmbedding(blocks)))
        elif isinstance(module, nn.Linear):
            replaced.append((path, GGMLLinear(blocks, bias=f"{path}.bias" in weights)))
        else:
            raise UnsupportedModelError(f"tensor {name} ({type_name}) is not a matrix Kiln reads as blocks")
    if repacked:
        how = "mapped the panels kept for" if all(w.mapped for w in read if w.repacked) else "read into panels of 16 rows"
        log.info("%s %d matrices (%.0f MB) in %.1f s", how, len(repacked), sum(repacked) / 1e6, time.perf_counter() - started)
    if replaced:
        model.update_modules(tree_unflatten(replaced))


def _build(arch: Architecture, args: dict[str, Any]) -> nn.Module:
    models = importlib.import_module(f"mlx_lm.models.{arch.module}")
    model: nn.Module = models.Model(models.ModelArgs.from_dict(args))
    return model


def load_gguf(path: str | Path, keep_blocks: bool = False, on_tokenizer: Callable[[Tokenizer], object] | None = None) -> tuple[nn.Module, Tokenizer, ModelInfo]:
    """Build the mlx-lm `Model`, our `Tokenizer` and `ModelInfo` from a GGUF file.

    With `keep_blocks` (the CPU worker with native kernels), the quantized matrices of llama-family
    models stay the file's blocks where the kernels read their type (ggml_blocks.KEPT_TYPES). Other quantized weights stay in mlx's
    quantized layout where the file's type has one; `device.prepare_weights` decides later
    whether to dequantize them for the CPU. The tokenizer is built (and given to `on_tokenizer`)
    before the weights are read.
    """
    path = Path(path)
    try:  # parsed once: a large vocabulary makes the header a sizeable part of a start
        header: GGUFHeader | None = read_header(path)
    except (OSError, ValueError):
        header = None  # read_gguf reads it again and says what is wrong with the file
    try:
        contents = read_gguf(path, _kept_types(header, keep_blocks), header=header)
    except UnsupportedTensorError as exc:
        raise UnsupportedModelError(str(exc)) from exc
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from exc
    md = contents.metadata

    arch_name = md.get("general.architecture")
    arch = ARCHITECTURES.get(str(arch_name))
    if arch is None:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {arch_name!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if arch.name == "phi3" and "rope_factors_long.weight" in contents.tensors:
        raise UnsupportedModelError(
            f"{path.name}: phi3 with long-context RoPE factors (rope_factors_long) is not supported"
        )

    try:
        tokenizer = Tokenizer.from_gguf_metadata(md)
    except UnsupportedTokenizerError as exc:
        raise UnsupportedModelError(f"{path.name}: {exc}") from exc
    if on_tokenizer is not None:
        on_tokenizer(tokenizer)
    weights = _rename(contents, arch)
    try:
        args = arch.model_args(md, has_output="output.weight" in contents.tensors or "output.weight" in contents.blocks)
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedModelError(f"{path.name}: {arch.name} hyperparameters missing or invalid: {exc}") from exc
    model = _build(arch, args)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)  # e.g. gemma3 drops its head when tied
    nn.quantize(model, class_predicate=lambda p, m: _quant_params(p, weights, m))
    _use_blocks(model, path, contents, arch, weights)
    rope_factors = contents.tensors.get("rope_freqs.weight")
    if rope_factors is not None and arch.name == "llama":
        for layer in model.model.layers:
            layer.self_attn.rope = FactorRoPE(args["head_dim"], args["rope_theta"], rope_factors)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise UnsupportedModelError(f"{path.name}: tensors do not match a {arch.name} model: {exc}") from exc
    mx.eval(model.parameters())
    file_type = scalar(md, "general.file_type")
    stored = contents.describe()
    log.info("%s: tensors %s", path.name, stored)
    info = ModelInfo(
        architecture=arch.name,
        name=md.get("general.name"),
        context_window=int(scalar(md, f"{arch.name}.context_length", DEFAULT_CONTEXT)),
        quantization=f"gguf:{_FILE_TYPES.get(file_type, file_type)}",
        extra={"tensor_types": stored, "conversions": dict(contents.conversions)},
    )
    return model, tokenizer, info
