"""Load a llama-architecture GGUF file into mlx-lm's llama model.

`mx.load` already reads GGUF tensors into mlx's quantized layout (packed
uint32 weights + per-group scales/biases; Q4_0/Q4_1 as 4-bit, Q8_0 as 8-bit,
group size 32), so loading is a matter of translating the hyperparameters to
`mlx_lm.models.llama.ModelArgs`, renaming tensors, and quantizing exactly the
modules the file stored quantized, each with the bits/group size its tensors
imply. GGUF stores Q/K rows permuted for interleaved RoPE, which is mlx's
`traditional=True`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from .info import ModelInfo
from .tokenizer import Tokenizer


class UnsupportedModelError(ValueError):
    """The file is valid GGUF but not a model this loader can build."""


SUPPORTED_ARCHITECTURES = ("llama",)

# llama.cpp `general.file_type`, for logs and the model listing.
_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S",
    15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16",
}  # fmt: skip

# GGUF tensor name (after "blk.N.") -> mlx-lm module path (after "model.layers.N.").
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


def _scalar(md: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = md.get(key, default)
    return value.item() if hasattr(value, "item") else value


def _mlx_name(gguf_name: str) -> str | None:
    """The mlx-lm parameter name for a GGUF tensor, or None to drop it."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, part, kind = m.groups()
        target = _BLOCK_NAMES.get(part)
        return None if target is None else f"model.layers.{layer}.{target}.{kind}"
    if m := _TOP_RE.match(gguf_name):
        part, kind = m.groups()
        target = _TOP_NAMES.get(part)
        return None if target is None else f"{target}.{kind}"
    return None


def _model_args(md: Mapping[str, Any], weights: Mapping[str, mx.array]) -> llama.ModelArgs:
    arch = "llama"
    n_heads = int(_scalar(md, f"{arch}.attention.head_count"))
    hidden = int(_scalar(md, f"{arch}.embedding_length"))
    key_len = _scalar(md, f"{arch}.attention.key_length")
    vocab = _scalar(md, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(md["tokenizer.ggml.tokens"])
    rope_scaling = None
    if _scalar(md, f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"type": "linear", "factor": float(_scalar(md, f"{arch}.rope.scaling.factor"))}
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(md, f"{arch}.block_count")),
        intermediate_size=int(_scalar(md, f"{arch}.feed_forward_length")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(_scalar(md, f"{arch}.attention.head_count_kv", n_heads)),
        rms_norm_eps=float(_scalar(md, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=int(vocab),
        head_dim=int(key_len) if key_len is not None else None,
        max_position_embeddings=int(_scalar(md, f"{arch}.context_length", 2048)),
        rope_theta=float(_scalar(md, f"{arch}.rope.freq_base", 10000.0)),
        rope_traditional=True,
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in weights,
    )


class _FactorRoPE(nn.Module):
    """Interleaved RoPE with per-dimension frequency factors (GGUF `rope_freqs`).

    Llama-3.1-style GGUFs bake their long-context frequency scaling into a
    `rope_freqs` tensor that divides each rotation frequency; mlx takes the
    equivalent wavelengths through `mx.fast.rope(freqs=...)`.
    """

    def __init__(self, dims: int, base: float, factors: mx.array) -> None:
        super().__init__()
        self.dims = dims
        exponents = mx.arange(0, dims, 2, dtype=mx.float32) / dims
        self._freqs = (base**exponents) * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=True, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def _quant_params(path: str, weights: Mapping[str, mx.array], module: nn.Module) -> dict | bool:
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


def load_gguf(path: str | Path) -> tuple[nn.Module, Tokenizer, ModelInfo]:
    """Build mlx-lm's llama `Model`, our `Tokenizer` and `ModelInfo` from a GGUF file.

    The weights stay in the file's quantized layout; `device.prepare_weights`
    decides later whether to dequantize them for the CPU.
    """
    path = Path(path)
    try:
        raw, md = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # mlx raises plain RuntimeError/ValueError for bad files
        raise UnsupportedModelError(f"cannot read GGUF {path}: {exc}") from exc

    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    weights: dict[str, mx.array] = {}
    for name, value in raw.items():
        target = _mlx_name(name)
        if target is not None:
            weights[target] = value
    rope_factors = raw.get("rope_freqs.weight")

    args = _model_args(md, raw)
    model = llama.Model(args)
    nn.quantize(model, class_predicate=lambda p, m: _quant_params(p, weights, m))
    if rope_factors is not None:
        head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
        for layer in model.model.layers:
            layer.self_attn.rope = _FactorRoPE(head_dim, args.rope_theta, rope_factors)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise UnsupportedModelError(f"{path.name}: tensors do not match a llama model: {exc}") from exc
    mx.eval(model.parameters())

    tokenizer = Tokenizer.from_gguf_metadata(md)
    file_type = _scalar(md, "general.file_type")
    info = ModelInfo(
        architecture=str(arch),
        name=md.get("general.name"),
        context_window=args.max_position_embeddings or 2048,
        quantization=f"gguf:{_FILE_TYPES.get(file_type, file_type)}",
    )
    return model, tokenizer, info
