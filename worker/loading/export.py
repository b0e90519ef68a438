"""Write a GGUF, as Kiln's loader reads it, out as an mlx-lm model folder.

The benchmark's peer servers (mlx_lm.server loads only mlx-lm folders) and the
folder-loading tests both need the very weights Kiln serves from a GGUF in
mlx-lm's format: config.json + model.safetensors + tokenizer files. This is
the one conversion they share, so that both read the same folder layout.

mlx is imported inside `export_folder`, as the rest of the package does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

Dtype = Literal["float32", "float16", "bfloat16"]


def export_folder(gguf_path: str | Path, out_dir: str | Path, *, dtype: Dtype | None = None) -> Path:
    """Convert the GGUF at `gguf_path` into an mlx-lm folder at `out_dir`; return it.

    `dtype` None keeps the GGUF's quantization (mlx-lm infers each quantized
    layer's bits from the tensor shapes, so e.g. an 8-bit embedding and 4-bit
    linears load as they are); a dtype name dequantizes every weight to it.
    Written for llama GGUFs (what `load_gguf` accepts) in Q4_0/Q4_1/Q8_0.
    Writes config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and special_tokens_map.json, replacing any there.
    """
    import mlx.core as mx

    from .device import dequantize_modules
    from .gguf import load_gguf
    from .parameters import flat_parameters

    model, tokenizer, info = load_gguf(Path(gguf_path))  # native (quantized) layout
    if dtype is not None:
        dequantize_modules(model, getattr(mx, dtype))
        mx.eval(model.parameters())
    args = model.args
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_theta": args.rope_theta,
        # GGUF stores Q/K rows for interleaved RoPE: mlx's traditional=True.
        "rope_traditional": True,
        "tie_word_embeddings": args.tie_word_embeddings,
        "eos_token_id": sorted(tokenizer.eos_token_ids),
    }
    if args.head_dim:
        config["head_dim"] = args.head_dim
    if args.rope_scaling:
        config["rope_scaling"] = args.rope_scaling
    if dtype is None:
        # mlx-lm infers per-layer bits from tensor shapes (say an 8-bit embedding);
        # mx.load reads Q4_0/Q4_1/Q8_0 tensors with group size 32.
        config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    else:
        config["torch_dtype"] = dtype

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = dict(flat_parameters(model))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer.hf_tokenizer.save(str(folder / "tokenizer.json"))
    eos_text = next((tokenizer.id_to_token(i) for i in sorted(tokenizer.eos_token_ids)), None)
    bos_id = tokenizer.bos_token_id
    tokenizer_config = {
        # transformers' generic fast tokenizer over tokenizer.json, as the GGUF defines it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tokenizer.chat_template,
        "bos_token": tokenizer.id_to_token(bos_id) if bos_id is not None else None,
        "eos_token": eos_text,
        "pad_token": eos_text,
        "add_bos_token": False,
        "model_max_length": info.context_window,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_tokens = {"eos_token": eos_text, "pad_token": eos_text}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_tokens, indent=2))
    return folder
