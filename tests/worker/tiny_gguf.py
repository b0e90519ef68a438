"""Tiny random-weight models of each GGUF architecture, written both ways.

`write_pair(arch, quant, tokenizer_md, out)` builds an mlx-lm model with random
weights, quantizes its matrices with the `gguf` package (or, for the K-quants
the package cannot encode, draws random valid blocks), and writes
- a GGUF file as llama.cpp's converter lays it out (Gemma norms as 1 + w), and
- an mlx-lm folder holding exactly the weights the GGUF decodes to (gguf-py's
  reference dequantization), so both must generate the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from kiln.worker.loading.gguf_arch import ARCHITECTURES, TOP_NAMES

# A ChatML template that renders tools, tool calls and tool results (Qwen-style).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=1024,
             rope_theta=10000.0)  # fmt: skip

# mlx-lm config per test case; "arch" is the GGUF architecture it is written as.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_BASE, model_type="llama", rope_traditional=True, tie_word_embeddings=True),
    # Mistral is written by llama.cpp as the llama architecture (here: untied head, 8k context).
    "mistral": dict(_BASE, model_type="llama", rope_traditional=True, tie_word_embeddings=False,
                    max_position_embeddings=8192, num_key_value_heads=1),
    "qwen2": dict({k: v for k, v in _BASE.items() if k != "head_dim"}, model_type="qwen2",
                  tie_word_embeddings=True),
    "qwen3": dict(_BASE, model_type="qwen3", tie_word_embeddings=True),
    "qwen3moe": dict(_BASE, model_type="qwen3_moe", tie_word_embeddings=False, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                     mlp_only_layers=[], norm_topk_prob=True),
    "phi3": dict({k: v for k, v in _BASE.items() if k != "head_dim"}, model_type="phi3",
                 num_key_value_heads=4, tie_word_embeddings=False, partial_rotary_factor=1.0,
                 original_max_position_embeddings=1024),
    "gemma2": dict({k: v for k, v in _BASE.items() if k != "max_position_embeddings"}, model_type="gemma2",
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16.0),
    "gemma3": dict(_BASE, model_type="gemma3_text", rope_theta=1_000_000.0, rope_local_base_freq=10000.0,
                   query_pre_attn_scalar=16.0, sliding_window=512, sliding_window_pattern=6,
                   num_hidden_layers=6),  # mlx-lm's gemma3 needs a full local/global pattern
}  # fmt: skip
GGUF_ARCH = {"mistral": "llama"}

_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "K": 15}  # K: like Q4_K_M
# Where the float16 super-block scales (d, and dmin where there is one) sit in each K block.
K_SCALE_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,), Q.Q2_K: (80, 82), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


def _hyper(writer: GGUFWriter, arch: str, cfg: Mapping[str, Any], vocab: int) -> None:
    a = arch
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_uint32(f"{a}.context_length", cfg.get("max_position_embeddings", 8192))
    writer.add_uint32(f"{a}.embedding_length", cfg["hidden_size"])
    writer.add_uint32(f"{a}.block_count", cfg["num_hidden_layers"])
    writer.add_uint32(f"{a}.feed_forward_length", cfg["intermediate_size"])
    writer.add_uint32(f"{a}.attention.head_count", heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", cfg["num_key_value_heads"])
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_float32(f"{a}.rope.freq_base", cfg["rope_theta"])
    writer.add_uint32(f"{a}.attention.key_length", head_dim)
    writer.add_uint32(f"{a}.attention.value_length", head_dim)
    writer.add_uint32(f"{a}.rope.dimension_count", head_dim)
    writer.add_uint32(f"{a}.vocab_size", vocab)
    if a == "qwen3moe":
        writer.add_uint32(f"{a}.expert_count", cfg["num_experts"])
        writer.add_uint32(f"{a}.expert_used_count", cfg["num_experts_per_tok"])
        writer.add_uint32(f"{a}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    if a == "gemma2":
        writer.add_float32(f"{a}.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        writer.add_float32(f"{a}.final_logit_softcapping", cfg["final_logit_softcapping"])
    if a == "gemma3":
        writer.add_uint32(f"{a}.attention.sliding_window", cfg["sliding_window"])


def _value(v: Any) -> Any:
    # mx.load gives 0-d / 1-d mx.arrays; the tiny SentencePiece metadata gives numpy or plain values.
    return v.tolist() if hasattr(v, "tolist") else v


def _tokenizer(writer: GGUFWriter, md: Mapping[str, Any], chat_template: str) -> None:
    writer.add_tokenizer_model(str(md["tokenizer.ggml.model"]))
    writer.add_tokenizer_pre(str(md.get("tokenizer.ggml.pre", "default")))
    writer.add_token_list(list(md["tokenizer.ggml.tokens"]))
    writer.add_token_types([int(t) for t in _value(md["tokenizer.ggml.token_type"])])
    if "tokenizer.ggml.merges" in md:
        writer.add_token_merges(list(md["tokenizer.ggml.merges"]))
    if "tokenizer.ggml.scores" in md:
        writer.add_token_scores([float(s) for s in _value(md["tokenizer.ggml.scores"])])
    if "tokenizer.ggml.add_space_prefix" in md:
        writer.add_add_space_prefix(bool(_value(md["tokenizer.ggml.add_space_prefix"])))
    for key, add in (("add_bos_token", writer.add_add_bos_token), ("add_eos_token", writer.add_add_eos_token)):
        if f"tokenizer.ggml.{key}" in md:
            add(bool(_value(md[f"tokenizer.ggml.{key}"])))
    writer.add_bos_token_id(int(_value(md["tokenizer.ggml.bos_token_id"])))
    writer.add_eos_token_id(int(_value(md["tokenizer.ggml.eos_token_id"])))
    if "tokenizer.ggml.unknown_token_id" in md:
        writer.add_unk_token_id(int(_value(md["tokenizer.ggml.unknown_token_id"])))
    writer.add_chat_template(chat_template)


def _inverse_names(arch: str) -> dict[str, str]:
    """mlx-lm parameter name -> GGUF tensor name, for this architecture."""
    spec = ARCHITECTURES[arch]
    return {v: k for k, v in spec.block_names.items()}, {v: k for k, v in TOP_NAMES.items()}


def _gguf_name(name: str, block: Mapping[str, str], top: Mapping[str, str]) -> str:
    module, kind = name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{block[rest]}.{kind}"
    return f"{top[module]}.{kind}"


def k_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q, scale: float | None = None) -> np.ndarray:
    """Random valid K-quant (or IQ4) blocks (gguf-py cannot encode them) for a tensor of `shape`.

    Every byte is random but the float16 super-block scales: `scale` (and half of it for the
    minimum's) when given, else random positive values from 2^-16 to 2^-6, float16 subnormals
    included, so that d * sc is rarely a float16 itself.
    """
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = shape[-1] // block
    blocks = rng.integers(0, 256, size=(*shape[:-1], n_blocks, size), dtype=np.uint8)
    for k, at in enumerate(K_SCALE_FIELDS[qtype]):
        if scale is None:
            values = np.exp2(rng.uniform(-16, -6, size=blocks.shape[:-1])).astype(np.float16)
        else:
            values = np.full(blocks.shape[:-1], scale / (1 + k), np.float16)
        blocks[..., at : at + 2] = values[..., None].view(np.uint8)
    return blocks.reshape(*shape[:-1], n_blocks * size)


def _encode(rng, name: str, w: np.ndarray, quant: str, k_types: tuple[Q, ...], k_scale: float = 2.0**-9) -> tuple[np.ndarray, Q | None]:
    """The stored bytes (or floats) of one tensor and its GGML type (None: plain F32)."""
    is_matrix = w.ndim >= 2 and not name.endswith("norm.weight")
    if not is_matrix or quant == "F32":
        return w.astype(np.float32), None
    if quant == "F16":
        return w.astype(np.float16), None
    if quant == "K":  # like Q4_K_M: K blocks where rows are 256 wide, else Q8_0
        if w.shape[-1] % 256 == 0:
            if name.startswith("model.layers."):
                qtype = k_types[int(name.split(".")[2]) % len(k_types)]
            else:  # the embedding and output head: Q6_K where it is one, as llama-quantize's Q4_K_M
                qtype = Q.Q6_K if Q.Q6_K in k_types else k_types[0]
            if qtype not in K_SCALE_FIELDS:  # a type gguf-py writes from the floats (Q4_1 beside Q6_K)
                return quants.quantize(w.astype(np.float32), qtype), qtype
            # Power-of-two super-block scales: d * sc and dmin * m are float16 themselves, so
            # Kiln's repack holds exactly gguf-py's values (test_gguf_quants checks the rest).
            return k_blocks(rng, w.shape, qtype, scale=k_scale), qtype
        qtype = Q.Q8_0
    else:
        qtype = Q[quant]
    return quants.quantize(w.astype(np.float32), qtype), qtype


def write_pair(case: str, quant: str, tokenizer_md: Mapping[str, Any], out: Path, *, seed: int = 0,
               config: Mapping[str, Any] | None = None, unreadable: str | None = None,
               tokenizer_model: str | None = None, chat_template: str | None = None,
               k_types: tuple[Q, ...] = (Q.Q4_K, Q.Q6_K, Q.Q5_K), k_scale: float = 2.0**-9,
               rope_factors: np.ndarray | None = None) -> tuple[Path, Path]:  # fmt: skip
    """Write `out/<case>-<quant>.gguf` and the equivalent mlx-lm folder; return both paths.

    `tokenizer_md` holds `tokenizer.*` keys as mx.load or tiny_spm gives them.
    `unreadable` names a GGUF tensor to store as Q8_1 instead (a type Kiln does not read: no file
    type uses it, llama.cpp keeps it for activations);
    `tokenizer_model` overrides the GGUF's `tokenizer.ggml.model` (the folder keeps the real one);
    `chat_template` replaces the GGUF's (a tools-rendering ChatML one by default);
    `k_types` are the K types quant "K" cycles through, one per layer (the embedding and output
    take Q6_K where it is one of them); `k_scale` is their super-block scale;
    `rope_factors` (head_dim / 2,) is written as Llama 3's `rope_freqs` tensor (the GGUF only: the
    folder's model keeps plain RoPE).
    """
    import importlib

    from mlx.utils import tree_flatten

    arch = GGUF_ARCH.get(case, case)
    template = chat_template or TOOLS_TEMPLATE
    cfg = dict(config or CONFIGS[case])
    if quant == "K":  # K blocks are 256 wide: make ffn_down that wide, one layer per K type
        cfg.update(intermediate_size=256, num_hidden_layers=max(3, cfg["num_hidden_layers"]))
    vocab = len(tokenizer_md["tokenizer.ggml.tokens"])
    cfg["vocab_size"] = vocab
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    models = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = models.Model(models.ModelArgs.from_dict(cfg))
    params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    if cfg["model_type"] == "gemma3_text" and cfg.get("tie_word_embeddings", True):
        params.pop("lm_head.weight", None)

    block, top = _inverse_names(arch)
    gemma = ARCHITECTURES[arch].norm_offset
    writer = GGUFWriter(str(out / f"{case}-{quant}.gguf"), arch)
    writer.add_name(f"tiny-{case}")
    writer.add_file_type(_FILE_TYPE[quant])
    _hyper(writer, arch, cfg, vocab)
    _tokenizer(writer, {**tokenizer_md, **({"tokenizer.ggml.model": tokenizer_model} if tokenizer_model else {})}, template)
    folder_weights: dict[str, mx.array] = {}
    for name, w in sorted(params.items()):
        if name.endswith("norm.weight"):
            w = (1.0 + 0.1 * rng.standard_normal(w.shape)).astype(np.float32)
        else:
            w = (0.08 * rng.standard_normal(w.shape)).astype(np.float32)
        stored, qtype = _encode(rng, name, w, quant, k_types, k_scale)
        if qtype is None:
            decoded = stored.astype(np.float32)
        else:
            decoded = quants.dequantize(stored, qtype).astype(np.float32)
            if qtype == Q.Q6_K:  # what Kiln serves Q6_K as: float16
                decoded = decoded.astype(np.float16).astype(np.float32)
        folder_weights[name] = mx.array(decoded)
        on_disk = stored + gemma if gemma and name.endswith("norm.weight") else stored
        gguf_name = _gguf_name(name, block, top)
        if gguf_name == unreadable:  # 40 bytes per 32 weights
            on_disk, qtype = np.zeros((*w.shape[:-1], w.shape[-1] // 32 * 40), np.uint8), Q.Q8_1
        writer.add_tensor(gguf_name, on_disk, raw_dtype=qtype)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", np.ascontiguousarray(rope_factors, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    folder = out / f"{case}-{quant}-mlx"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [0, 2]}))
    mx.save_safetensors(str(folder / "model.safetensors"), folder_weights)
    from kiln.worker.loading.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata({**tokenizer_md, "general.name": f"tiny-{case}"})
    tok.hf_tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
        "bos_token": tok.id_to_token(int(_value(tokenizer_md["tokenizer.ggml.bos_token_id"]))),
        "eos_token": tok.id_to_token(int(_value(tokenizer_md["tokenizer.ggml.eos_token_id"]))),
        "add_bos_token": False}))  # fmt: skip
    return out / f"{case}-{quant}.gguf", folder


PROMPT = [{"role": "user", "content": "Name three colours."}]


def greedy(loaded, n: int = 8, messages: list[dict[str, Any]] = PROMPT) -> tuple[list[int], np.ndarray]:
    """`n` greedy tokens after the chat-rendered `messages`, and the first step's logits."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    tok = loaded.tokenizer
    prompt = mx.array(tok.encode(tok.apply_chat_template(messages)))
    first_logits = np.array(loaded.model(prompt[None])[0, -1].astype(mx.float32))
    ids = [int(t) for t, _ in generate_step(prompt, loaded.model, max_tokens=n, sampler=make_sampler(0.0))]
    return ids, first_logits
