"""``kiln serve --config kiln.toml``: several models behind one endpoint.

    [[models]]
    id = "smollm2"                       # the name clients use
    source = "mlx-community/Qwen3-4B-4bit"  # a path (GGUF file, mlx-lm folder) or a hub id
    aliases = ["small"]
    workers = 1
    context_length = 8192                # optional caps and settings, per model
    max_batch = 8
    cache_bytes = 1073741824
    tool_parser = "hermes"

Each model gets its own worker processes, started with that model's flags; the gateway
routes a request to the workers that announced its `id` or an alias. Checked whole before
anything starts: an unknown key, a duplicate name or a bad value fails with its place.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """The config file is unreadable or says something Kiln cannot do."""


@dataclass(frozen=True)
class ModelConfig:
    id: str
    source: str
    aliases: tuple[str, ...] = ()
    workers: int = 1
    context_length: int | None = None
    max_batch: int | None = None
    cache_bytes: int | None = None
    tool_parser: str | None = None
    load: str = "always"

    def worker_settings(self) -> dict[str, Any]:
        """The worker settings (``WorkerSettings`` fields) this model's workers get over the rest."""
        values: dict[str, Any] = {"model": self.source, "model_id": self.id, "model_alias": self.aliases}
        for name in ("context_length", "max_batch", "cache_bytes", "tool_parser"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return values


@dataclass(frozen=True)
class ServeConfig:
    models: list[ModelConfig] = field(default_factory=list)


_TYPES: dict[str, type | tuple[type, ...]] = {
    "id": str, "source": str, "aliases": list, "workers": int, "context_length": int,
    "max_batch": int, "cache_bytes": int, "tool_parser": str, "load": str,
}  # fmt: skip


def _model(entry: Any, where: str, base: Path) -> ModelConfig:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a table")
    for key in entry:
        if key not in _TYPES:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(_TYPES)})")
    for key in ("id", "source"):
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            raise ConfigError(f"{where}: {key} is required (a non-empty string)")
    for key, kind in _TYPES.items():
        value = entry.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ConfigError(f"{where}: {key} must be a {kind.__name__}")
    aliases = entry.get("aliases", [])
    if not all(isinstance(a, str) and a for a in aliases):
        raise ConfigError(f"{where}: aliases must be a list of names")
    for key in ("workers", "context_length", "max_batch"):
        if key in entry and entry[key] < 1:
            raise ConfigError(f"{where}: {key} must be at least 1")
    if entry.get("cache_bytes", 0) < 0:
        raise ConfigError(f"{where}: cache_bytes must not be negative")
    load = entry.get("load", "always")
    if load != "always":
        # On-demand loading (start at first request, stop when idle) is not built yet.
        raise ConfigError(f"{where}: load = {load!r} is not supported yet (only \"always\")")
    source = entry["source"]
    local = (base / source).expanduser()
    if not Path(source).expanduser().is_absolute() and local.exists():
        source = str(local)  # relative paths are relative to the config file
    return ModelConfig(
        id=entry["id"], source=source, aliases=tuple(aliases), workers=entry.get("workers", 1),
        context_length=entry.get("context_length"), max_batch=entry.get("max_batch"),
        cache_bytes=entry.get("cache_bytes"), tool_parser=entry.get("tool_parser"), load=load,
    )  # fmt: skip


def load_config(path: str | Path) -> ServeConfig:
    """Parse and check `path`; ConfigError says what is wrong and where."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    unknown = set(data) - {"models"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s): {', '.join(sorted(unknown))}")
    entries = data.get("models")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: needs at least one [[models]] table")
    models = [_model(e, f"{path.name}: models[{i}]", path.parent) for i, e in enumerate(entries)]
    seen: dict[str, str] = {}
    for m in models:
        for name in (m.id, *m.aliases):
            if name in seen and seen[name] != m.id:
                raise ConfigError(f"{path.name}: the name {name!r} is used by both {seen[name]!r} and {m.id!r}")
            seen[name] = m.id
    return ServeConfig(models)
