"""The native pass's build check, remembered per model file and kernel build.

Why: before decoding with the native pass, ``NativeDecoder.build`` runs it against mlx's
forward pass on the real weights (two prompts prefilled by mlx, a three-token step and three
single steps, through both). On a 1B model on one core that is many seconds of every start,
and twice that where the 8-bit activations fail and float32 ones are tried. Its verdict depends
only on what is compared, so a worker that starts again on the same file with the same kernels
and code takes the verdict from the cache and starts that much sooner.

The key (``CheckSource.key``) covers everything the verdict depends on:
  - the model file or folder (resolved path, size and modification time of each file);
  - the loaded kernel library (its file name already hashes the C sources, compiler flags, CPU);
  - the Python that loads the weights and builds and checks the pass (a hash of every source
    file of worker/engine, worker/loading and worker/native), and mlx's and mlx-lm's versions
    (the reference);
  - the settings that change what is compared: the weight layout, and every KILN_NATIVE_* and
    KILN_CPU_EXP variable.
Each mode's verdict (8-bit activations, float32 activations) is stored once checked, as JSON
under the native kernels' cache folder (``verdicts/``). ``KILN_NATIVE_RECHECK=1`` ignores what
is stored and checks again (the result is stored).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import mlx.nn as nn

from ..native.build import _cache_dir, _truthy, cpu_kernels
from ..native.kept import KeptJson
from .kv_int8 import KVCacheType
from .native_decode import NativeDecoder

log = logging.getLogger(__name__)

RECHECK_ENV = "KILN_NATIVE_RECHECK"
_WORKER = Path(__file__).resolve().parent.parent
_CODE_FOLDERS = ("engine", "loading", "native")


@lru_cache(maxsize=1)
def _code_hash() -> str:
    """The Python and C sources that load weights and build and check the native pass."""
    digest = hashlib.sha256()
    for folder in _CODE_FOLDERS:
        for path in sorted((_WORKER / folder).iterdir()):
            if path.suffix in (".py", ".c", ".h"):
                digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _files_identity(path: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of the model file, or of each file of a model folder."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [(p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


@dataclass(frozen=True)
class CheckSource:
    """What the worker loaded: the model's path and the settings that shape its weights."""

    model_path: Path
    weights: str = "auto"
    weight_layout: str = "auto"

    def key(self, library: str) -> str:
        path = self.model_path.resolve()
        env = {k: v for k, v in os.environ.items() if (k.startswith("KILN_NATIVE_") and k != RECHECK_ENV) or k == "KILN_CPU_EXP"}
        ident = {
            "model": str(path),
            "files": _files_identity(path),
            "library": library,
            "code": _code_hash(),
            "mlx": _version("mlx"),
            "mlx_lm": _version("mlx-lm"),
            "weights": self.weights,
            "layout": self.weight_layout,
            "env": sorted(env.items()),
        }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


# A check's mode: its activations, then "/kv-int8" where the pass keeps the 8-bit KV cache.
_MODES = ("int8", "float32", "int8/kv-int8", "float32/kv-int8")


class VerdictStore:
    """Verdicts by key: {mode: bool} (``_MODES``), one small JSON file each (``kept``)."""

    def __init__(self, folder: Path | None = None) -> None:
        self._kept = KeptJson(folder or _cache_dir() / "verdicts")

    def get(self, key: str) -> dict[str, bool]:
        verdicts = (self._kept.get(key) or {}).get("verdicts")
        if not isinstance(verdicts, dict):
            return {}
        return {k: v for k, v in verdicts.items() if k in _MODES and isinstance(v, bool)}

    def put(self, key: str, verdicts: dict[str, bool], model: Path) -> None:
        """A cache that cannot be written (read-only home) only costs the next start its check."""
        self._kept.put(key, {"model": str(model), "verdicts": verdicts})


def build_checked(model: nn.Module, source: CheckSource | None, store: VerdictStore | None = None, kv: KVCacheType = "float32") -> NativeDecoder | None:
    """``NativeDecoder.build(model, kv)``, with each mode's build check taken from the cache where
    this file, kernel build and code were checked before (``source`` None: always checked)."""
    kernels = cpu_kernels() if source is not None else None
    library = getattr(getattr(kernels, "library", None), "_name", None)
    if source is None or not library:
        return NativeDecoder.build(model, kv)
    checked, kept = source, store or VerdictStore()  # not None, for the class below too
    key = checked.key(os.path.basename(library))
    known = {} if _truthy(RECHECK_ENV) else kept.get(key)
    verdicts = dict(known)

    class _Remembered(NativeDecoder):
        def _matches(self, model: nn.Module) -> bool:
            mode = ("int8" if self.int8 else "float32") + ("/kv-int8" if self.kv_int8 else "")
            if mode in known:
                log.info("native build check (%s): %s, as when this model and kernel build were checked before", mode, "passed" if known[mode] else "failed")
                return known[mode]
            began = time.monotonic()
            verdicts[mode] = super()._matches(model)
            log.info("native build check (%s): %s in %.1f s; kept for later starts", mode, "passed" if verdicts[mode] else "failed", time.monotonic() - began)
            kept.put(key, verdicts, checked.model_path)
            return verdicts[mode]

    return _Remembered.build(model, kv)
