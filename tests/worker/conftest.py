"""Fixtures for the worker's loading tests: the bundled GGUF and an mlx-lm folder made from it.

Loading is the slow part of these tests, so the loaded models are shared per session.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from kiln.worker.loading import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def gguf_tokenizer(gguf_path):
    """The Tokenizer built from the GGUF's metadata alone (no weights kept)."""
    import mlx.core as mx

    from kiln.worker.loading.tokenizer import Tokenizer

    _, metadata = mx.load(str(gguf_path), return_metadata=True)
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="session")
def gguf_model():
    """The bundled model as load_model(None) gives it (dequantized to float32 on the CPU)."""
    from kiln.worker.loading import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def mlx_folder(tmp_path_factory, gguf_path) -> Path:
    """The bundled GGUF converted to an mlx-lm folder, keeping its quantized weights.

    config.json follows mlx-lm's llama ModelArgs; mlx-lm infers each quantized
    layer's bits from the tensor shapes, so the 8-bit embedding and 4-bit
    linears load as they are.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kiln.worker.loading.gguf import load_gguf

    model, tokenizer, info = load_gguf(gguf_path)
    folder = tmp_path_factory.mktemp("smollm2-mlx")
    args = model.args
    config = {
        "model_type": "llama",
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_theta": args.rope_theta,
        "rope_traditional": True,
        "tie_word_embeddings": args.tie_word_embeddings,
        "quantization": {"group_size": 32, "bits": 4, "mode": "affine"},
        "eos_token_id": sorted(tokenizer.eos_token_ids),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    tokenizer.hf_tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "chat_template": tokenizer.chat_template,
        "bos_token": tokenizer.id_to_token(tokenizer.bos_token_id),
        "eos_token": "<|im_end|>",
        "model_max_length": info.context_window,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return folder
