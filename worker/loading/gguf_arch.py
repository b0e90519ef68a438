"""How each GGUF architecture maps onto an mlx-lm model class.

llama.cpp's converter writes every architecture with one tensor vocabulary
(`blk.N.attn_q.weight`, `ffn_norm`, ...) and `<arch>.*` hyperparameter keys; what
differs per architecture is which mlx-lm module a name lands on, the model
arguments, and the converter's own changes to the weights, undone here:

- llama (also Mistral, which llama.cpp writes as llama): Q/K rows permuted for
  interleaved RoPE, which is mlx's `traditional=True`.
- qwen2/qwen3/qwen3moe/phi3/gemma: stored as trained (NeoX RoPE, mlx's default).
- gemma2/gemma3: RMSNorm weights stored as 1 + w (ggml's norm has no offset),
  while mlx-lm's Gemma norms add the 1 themselves: 1 is subtracted at load.
- phi3: fused qkv and gate/up projections, as mlx-lm's phi3 has them.
- qwen3moe: experts stacked in 3-d tensors, as mlx-lm's SwitchGLU holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_COMMON_BLOCK = {
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
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_BLOCK = {
    **_COMMON_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_BLOCK = {
    **{k: v for k, v in _COMMON_BLOCK.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate")},
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_MOE_BLOCK = {
    **_COMMON_BLOCK,
    **_QK_NORM,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}


def scalar(md: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar (mx.load gives 0-d arrays)."""
    value = md.get(key, default)
    return value.item() if hasattr(value, "item") else value


class _Hyper:
    """`<arch>.*` keys with the defaults llama.cpp assumes."""

    def __init__(self, md: Mapping[str, Any], arch: str, has_output: bool) -> None:
        self.md, self.arch, self.has_output = md, arch, has_output

    def get(self, key: str, default: Any = None) -> Any:
        return scalar(self.md, f"{self.arch}.{key}", default)

    def common(self) -> dict[str, Any]:
        heads = int(self.get("attention.head_count"))
        hidden = int(self.get("embedding_length"))
        vocab = self.get("vocab_size") or len(self.md["tokenizer.ggml.tokens"])
        args: dict[str, Any] = {
            "hidden_size": hidden,
            "num_hidden_layers": int(self.get("block_count")),
            "intermediate_size": int(self.get("feed_forward_length", 0)),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.get("attention.head_count_kv", heads)),
            "rms_norm_eps": float(self.get("attention.layer_norm_rms_epsilon", 1e-5)),
            "vocab_size": int(vocab),
            "max_position_embeddings": int(self.get("context_length", 2048)),
            "rope_theta": float(self.get("rope.freq_base", 10000.0)),
            "tie_word_embeddings": not self.has_output,
        }
        key_len = self.get("attention.key_length")
        args["head_dim"] = int(key_len) if key_len is not None else hidden // heads
        if self.get("rope.scaling.type") == "linear":
            args["rope_scaling"] = {"type": "linear", "factor": float(self.get("rope.scaling.factor"))}
        return args


def _llama_args(h: _Hyper) -> dict[str, Any]:
    return {**h.common(), "model_type": "llama", "rope_traditional": True}


def _qwen2_args(h: _Hyper) -> dict[str, Any]:
    args = h.common()
    args.pop("head_dim")
    return {**args, "model_type": "qwen2"}


def _qwen3_args(h: _Hyper) -> dict[str, Any]:
    return {**h.common(), "model_type": "qwen3"}


def _qwen3moe_args(h: _Hyper) -> dict[str, Any]:
    args = h.common()
    expert_ff = int(h.get("expert_feed_forward_length"))
    return {
        **args,
        "model_type": "qwen3_moe",
        "intermediate_size": args["intermediate_size"] or expert_ff,
        "num_experts": int(h.get("expert_count")),
        "num_experts_per_tok": int(h.get("expert_used_count")),
        "moe_intermediate_size": expert_ff,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,  # llama.cpp always renormalizes qwen3moe's top-k weights
    }


def _phi3_args(h: _Hyper) -> dict[str, Any]:
    args = h.common()
    head_dim = args.pop("head_dim")
    rope_dims = int(h.get("rope.dimension_count", head_dim))
    return {**args, "model_type": "phi3", "partial_rotary_factor": rope_dims / head_dim,
            "original_max_position_embeddings": int(h.get("rope.scaling.original_context_length",
                                                          args["max_position_embeddings"]))}  # fmt: skip


def _query_scale(args: dict[str, Any]) -> float:
    # llama.cpp: 1/sqrt(head_dim), except Gemma 2/3 27B which scale by hidden/heads.
    if args["num_hidden_layers"] in (46, 62):
        return float(args["hidden_size"] / args["num_attention_heads"])
    return float(args["head_dim"])


def _gemma2_args(h: _Hyper) -> dict[str, Any]:
    args = h.common()
    args.pop("tie_word_embeddings")
    args.pop("max_position_embeddings")
    args.pop("rope_scaling", None)
    return {
        **args,
        "model_type": "gemma2",
        "attn_logit_softcapping": float(h.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(h.get("final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": _query_scale(args),
    }


def _gemma3_args(h: _Hyper) -> dict[str, Any]:
    args = h.common()
    args.pop("tie_word_embeddings")
    theta = args.pop("rope_theta")
    return {
        **args,
        "model_type": "gemma3_text",
        "rope_theta": theta,
        "rope_local_base_freq": 10000.0,  # llama.cpp's fixed local (sliding) base
        "sliding_window": int(h.get("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,  # llama.cpp's fixed pattern for gemma3
        "query_pre_attn_scalar": _query_scale(args),
    }


@dataclass(frozen=True)
class Architecture:
    """One GGUF `general.architecture` and how it becomes an mlx-lm model."""

    name: str
    module: str  # mlx_lm.models.<module>
    block_names: Mapping[str, str]
    args: Callable[[_Hyper], dict[str, Any]]
    norm_offset: float = 0.0  # subtracted from every *norm.weight (Gemma's 1 + w)

    def model_args(self, md: Mapping[str, Any], has_output: bool) -> dict[str, Any]:
        return self.args(_Hyper(md, self.name, has_output))


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", "llama", _COMMON_BLOCK, _llama_args),
        Architecture("qwen2", "qwen2", _COMMON_BLOCK, _qwen2_args),
        Architecture("qwen3", "qwen3", {**_COMMON_BLOCK, **_QK_NORM}, _qwen3_args),
        Architecture("qwen3moe", "qwen3_moe", _MOE_BLOCK, _qwen3moe_args),
        Architecture("phi3", "phi3", _PHI3_BLOCK, _phi3_args),
        Architecture("gemma2", "gemma2", _GEMMA_BLOCK, _gemma2_args, norm_offset=1.0),
        Architecture("gemma3", "gemma3_text", {**_GEMMA_BLOCK, **_QK_NORM}, _gemma3_args, norm_offset=1.0),
    )
}

TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Context window when a file declares none (never used for a key that exists).
DEFAULT_CONTEXT = 2048
