"""The model list of a deployment: ``kiln.toml`` with ``[[models]]`` tables.

    memory_budget = "6GB"                # optional: what the models' workers may take together

    [[models]]
    id = "smollm2"                       # the name clients use
    source = "mlx-community/Qwen3-4B-4bit"  # a path (GGUF file, mlx-lm folder) or a hub id
    aliases = ["small"]
    workers = 1
    context_length = 8192                # optional caps and settings, per model
    max_batch = 8
    cache_bytes = 1073741824
    kv_cache = "int8"                    # the KV cache in 8 bits (GGUF files on the CPU)
    tool_parser = "hermes"
    load = "on-demand"                   # "always" (default): started with the server
    idle_stop = "10m"                    # on-demand only: stopped after this long without requests
    memory = "900MB"                     # what one of its workers takes (needed with memory_budget)
    upstream = "http://10.0.0.5:8000"    # optional: generate on this engine (docs/upstream.md);
    upstream_kind = "vllm"               #   "llama-server" (default), "vllm" or "sglang"

One file serves every process of a deployment, which is why it is read here, in the package both
daemons share: ``kiln serve --config`` starts each model's workers, ``kiln-worker --config F
--model-id X`` takes model X's settings from it, and ``kiln-gateway --config F`` knows the whole
list (models not loaded yet are listed, and answer 503 rather than 404). Checked whole before
anything starts: an unknown key, a duplicate name or a bad value fails with its place.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

LoadMode = Literal["always", "on-demand"]
LOAD_MODES: tuple[LoadMode, ...] = ("always", "on-demand")
# An on-demand model without `idle_stop` is stopped after ten minutes without requests.
DEFAULT_IDLE_STOP_S = 600.0


# How the worker stores the KV cache (kiln-worker --kv-cache; worker/engine/kv_int8.py).
KVCacheType = Literal["float32", "int8"]
KV_CACHE_TYPES: tuple[KVCacheType, ...] = get_args(KVCacheType)


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
    kv_cache: KVCacheType | None = None
    tool_parser: str | None = None
    load: LoadMode = "always"
    idle_stop_s: float = DEFAULT_IDLE_STOP_S  # on-demand models only
    memory: int | None = None  # bytes one worker of this model takes, as the user declared it
    # An engine that generates for this model's workers (kiln-worker --engine upstream); source
    # then names only its tokenizer and chat template.
    upstream: str | None = None
    upstream_kind: str | None = None
    upstream_model: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)

    @property
    def on_demand(self) -> bool:
        return self.load == "on-demand"

    def worker_settings(self) -> dict[str, Any]:
        """The worker settings (``WorkerSettings`` fields) this model's workers get over the rest."""
        values: dict[str, Any] = {"model": self.source, "model_id": self.id, "model_alias": self.aliases}
        for name in ("context_length", "max_batch", "cache_bytes", "kv_cache", "tool_parser", "upstream", "upstream_kind", "upstream_model"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.upstream is not None:
            values["engine"] = "upstream"
        return values


@dataclass(frozen=True)
class ServeConfig:
    models: list[ModelConfig] = field(default_factory=list)
    memory_budget: int | None = None  # bytes

    def lookup(self, name: str) -> ModelConfig | None:
        """The model that `name` (an id or an alias) names, or None."""
        return next((m for m in self.models if name in m.names), None)

    def model(self, model_id: str) -> ModelConfig:
        """The model whose id is `model_id`; ConfigError names the ids there are."""
        for m in self.models:
            if m.id == model_id:
                return m
        raise ConfigError(f"no [[models]] entry has id {model_id!r} (ids: {', '.join(m.id for m in self.models)})")


_TYPES: dict[str, type | tuple[type, ...]] = {
    "id": str, "source": str, "aliases": list, "workers": int, "context_length": int,
    "max_batch": int, "cache_bytes": int, "kv_cache": str, "tool_parser": str, "load": str,
    "idle_stop": (int, float, str), "memory": (int, str),
    "upstream": str, "upstream_kind": str, "upstream_model": str,
}  # fmt: skip
UPSTREAM_KINDS = ("llama-server", "vllm", "sglang")  # kiln-worker --upstream-kind

_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*")
_SECONDS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_BYTES = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_duration(value: Any, where: str) -> float:
    """Seconds from a number of seconds or a string such as "90s", "10m", "1.5h"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value)):
        seconds = float(match[1]) * _SECONDS[match[2]]
    else:
        raise ConfigError(f"{where}: expected seconds or a duration such as \"90s\", \"10m\", \"1h\", got {value!r}")
    if not 0 < seconds < float(1 << 32):
        raise ConfigError(f"{where}: must be above 0 seconds, got {value!r}")
    return seconds


def parse_size(value: Any, where: str) -> int:
    """Bytes from a number of bytes or a string such as "800MB", "1.5GB", "2GiB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value)):
        size = int(float(match[1]) * _BYTES[(match[2] or "b").lower()])
    else:
        raise ConfigError(f"{where}: expected bytes or a size such as \"800MB\", \"1.5GB\", \"2GiB\", got {value!r}")
    if not 0 < size < 1 << 60:
        raise ConfigError(f"{where}: must be above 0 bytes, got {value!r}")
    return size


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
            names = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
            raise ConfigError(f"{where}: {key} must be a {names}")
    aliases = entry.get("aliases", [])
    if not all(isinstance(a, str) and a for a in aliases):
        raise ConfigError(f"{where}: aliases must be a list of names")
    for key in ("workers", "context_length", "max_batch"):
        if key in entry and entry[key] < 1:
            raise ConfigError(f"{where}: {key} must be at least 1")
    if entry.get("cache_bytes", 0) < 0:
        raise ConfigError(f"{where}: cache_bytes must not be negative")
    if "kv_cache" in entry and entry["kv_cache"] not in KV_CACHE_TYPES:
        raise ConfigError(f"{where}: kv_cache must be one of {', '.join(repr(k) for k in KV_CACHE_TYPES)}, got {entry['kv_cache']!r}")
    load = entry.get("load", "always")
    if load not in LOAD_MODES:
        raise ConfigError(f"{where}: load must be one of {', '.join(repr(m) for m in LOAD_MODES)}, got {load!r}")
    if "idle_stop" in entry and load != "on-demand":
        raise ConfigError(f"{where}: idle_stop applies to load = \"on-demand\" models only")
    idle = parse_duration(entry["idle_stop"], f"{where}: idle_stop") if "idle_stop" in entry else DEFAULT_IDLE_STOP_S
    memory = parse_size(entry["memory"], f"{where}: memory") if "memory" in entry else None
    if "upstream_kind" in entry and entry["upstream_kind"] not in UPSTREAM_KINDS:
        raise ConfigError(f"{where}: upstream_kind must be one of {', '.join(repr(k) for k in UPSTREAM_KINDS)}, got {entry['upstream_kind']!r}")
    if ("upstream_kind" in entry or "upstream_model" in entry) and "upstream" not in entry:
        raise ConfigError(f"{where}: upstream_kind and upstream_model need upstream (the engine's URL)")
    source = entry["source"]
    local = (base / source).expanduser()
    if not Path(source).expanduser().is_absolute() and local.exists():
        source = str(local)  # relative paths are relative to the config file
    return ModelConfig(
        id=entry["id"], source=source, aliases=tuple(aliases), workers=entry.get("workers", 1),
        context_length=entry.get("context_length"), max_batch=entry.get("max_batch"),
        cache_bytes=entry.get("cache_bytes"), kv_cache=entry.get("kv_cache"), tool_parser=entry.get("tool_parser"), load=load,
        idle_stop_s=idle, memory=memory, upstream=entry.get("upstream"),
        upstream_kind=entry.get("upstream_kind"), upstream_model=entry.get("upstream_model"),
    )  # fmt: skip


def _check_budget(models: list[ModelConfig], budget: int, where: str) -> None:
    """With a budget every on-demand model must say what it takes (else a start could not be
    checked before it loads), and each must fit beside the models that are always loaded."""
    always = sum((m.memory or 0) * m.workers for m in models if not m.on_demand)
    if always > budget:
        raise ConfigError(f"{where}: the always-loaded models' memory ({always} bytes) exceeds memory_budget ({budget} bytes)")
    for m in models:
        if not m.on_demand:
            continue
        if m.memory is None:
            raise ConfigError(f"{where}: model {m.id!r} is on-demand and memory_budget is set: give it memory = \"...\" (what one of its workers takes)")
        if always + m.memory * m.workers > budget:
            raise ConfigError(f"{where}: model {m.id!r} ({m.memory * m.workers} bytes) cannot fit in memory_budget ({budget} bytes) beside the always-loaded models")


def load_config(path: str | Path) -> ServeConfig:
    """Parse and check `path`; ConfigError says what is wrong and where."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    unknown = set(data) - {"models", "memory_budget"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s): {', '.join(sorted(unknown))} (known: models, memory_budget)")
    entries = data.get("models")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: needs at least one [[models]] table")
    models = [_model(e, f"{path.name}: models[{i}]", path.parent) for i, e in enumerate(entries)]
    seen: dict[str, str] = {}
    for m in models:
        for name in m.names:
            if name in seen and seen[name] != m.id:
                raise ConfigError(f"{path.name}: the name {name!r} is used by both {seen[name]!r} and {m.id!r}")
            seen[name] = m.id
    ids = [m.id for m in models]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate is not None:
        raise ConfigError(f"{path.name}: two [[models]] tables have id {duplicate!r}")
    budget = parse_size(data["memory_budget"], f"{path.name}: memory_budget") if "memory_budget" in data else None
    if budget is not None:
        _check_budget(models, budget, path.name)
    return ServeConfig(models, budget)
