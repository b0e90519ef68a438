"""Load an mlx-lm model folder (config.json + *.safetensors + tokenizer files).

The model itself is built by mlx-lm's own loader, which knows every
architecture and quantization format mlx-lm supports; only the tokenizer is
ours, so that folder and GGUF models look the same to the rest of the worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm.utils import load_model as mlx_lm_load_model

from .info import ModelInfo
from .tokenizer import Tokenizer

# config.json keys that hold the trained context length, most specific first.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx")
DEFAULT_CONTEXT_WINDOW = 4096


def _context_window(config: dict[str, Any]) -> int:
    for source in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return DEFAULT_CONTEXT_WINDOW


def _quantization(config: dict[str, Any]) -> str:
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict):
        mode = quant.get("mode") or quant.get("quant_method") or "affine"
        bits = quant.get("bits")
        return f"{mode}-{bits}bit" if bits else str(mode)
    return str(config.get("torch_dtype") or config.get("dtype") or "unknown")


def load_folder(path: str | Path) -> tuple[nn.Module, Tokenizer, ModelInfo]:
    """Build the model with mlx-lm and the tokenizer with `Tokenizer.from_folder`."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not an mlx-lm model folder (no config.json)")
    model, config = mlx_lm_load_model(folder)
    tokenizer = Tokenizer.from_folder(folder)
    info = ModelInfo(
        architecture=str(config.get("model_type", "unknown")),
        name=config.get("_name_or_path") or folder.name,
        context_window=_context_window(config),
        quantization=_quantization(config),
    )
    return model, tokenizer, info
