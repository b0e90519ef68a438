"""The model's tokenizer, chat template and window, without its weights.

The upstream engine (vLLM, SGLang, llama-server) holds the weights; the worker still renders
every prompt and reads every output token itself, so it needs exactly what the MLX worker
builds at load, from the same sources: a GGUF's metadata (read from its header, no tensor
data), an mlx-lm / Hugging Face folder, or a hub id resolved in the local cache
(``loading/loader.py`` ``locate_model``, shared with the weight loader).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..loading.errors import ModelNotFoundError, UnsupportedModelError
from ..loading.loader import locate_model
from ..loading.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenizerSource:
    tokenizer: Tokenizer
    model_id: str
    aliases: list[str]
    context_window: int


def load_tokenizer(model: str | None) -> TokenizerSource:
    """The tokenizer of ``model`` (None: the bundled SmolLM2), named as ``kiln-worker --model``
    names a model. Raises ModelNotFoundError / UnsupportedModelError like ``load_model``."""
    path, model_id, aliases = locate_model(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        tokenizer, window = _from_gguf(path)
    elif path.is_dir() and (path / "config.json").is_file():
        tokenizer, window = _from_folder(path)
    elif not path.exists():
        raise ModelNotFoundError(f"model not found: {path}")
    else:
        raise ModelNotFoundError(f"cannot load {path}: expected a .gguf file or a model folder with config.json")
    return TokenizerSource(tokenizer, model_id, aliases, window)


def _from_gguf(path: Path) -> tuple[Tokenizer, int]:
    from ..loading.gguf_arch import DEFAULT_CONTEXT, scalar
    from ..loading.gguf_header import read_header
    from ..loading.gguf_read import _metadata
    from ..loading.gguf_vocab import UnsupportedTokenizerError

    try:
        metadata = _metadata(read_header(path))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"{path.name}: {exc}") from exc
    try:
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
    except UnsupportedTokenizerError as exc:
        raise UnsupportedModelError(f"{path.name}: {exc}") from exc
    arch = metadata.get("general.architecture")
    return tokenizer, int(scalar(metadata, f"{arch}.context_length", DEFAULT_CONTEXT))


def _from_folder(path: Path) -> tuple[Tokenizer, int]:
    from ..loading.folder import _context_window

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return Tokenizer.from_folder(path), _context_window(config)
