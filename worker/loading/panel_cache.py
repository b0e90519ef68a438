"""A GGUF's panels read once per file and kernel build, kept on disk and mapped at later starts.

Why: on a 2-core VM a 1B Q4_K_M start spent 0.8-1.0 s reading 680 MB into panels (the pack, and
fresh memory to pack into) while the gateway and the grammar compiler started on the same two
cores; a Q8_0 file's 1.1 GB took 1.3-2.0 s. llama-server maps its file, whose pages are already
in the page cache, and is ready in about a second. Kept here, the panels are a file like the
GGUF: a later start maps them (pages shared with the page cache, dropped and read again under
memory pressure, as llama.cpp's are), packs nothing and reads none of the GGUF's quantized blocks.

- Where: ``<native cache>/panels/<key>.panels`` (each matrix's panels page-aligned, in the order
  the loader gives them) and ``<key>.json``, the index (per matrix: its type, rows, width, panel
  type, panel row bytes and offset; the data file's size), written after the data file is in
  place: a start that finds the index finds the whole file.
- Key: the GGUF's resolved path, size, modification time and inode, the kernel library's name
  (its hash covers the C sources, flags and CPU) and this module's ``FORMAT``.
- Bound: the ``KEPT_FILES`` most recently used files; older ones are removed when one is written.
- Check: before a kept file is used, two rows of three of its matrices are read back and must
  equal the GGUF's own rows bit for bit; else it is removed and the panels are read again.
- ``KILN_NATIVE_PANEL_CACHE=0`` turns it off (every start reads the panels from the GGUF); an
  absolute path there keeps them in that folder instead.

The first start of a file pays the write on top of the read (about 0.2-0.5 s a GB into the page
cache; the disk gets it later); a folder that cannot be written only means the next start reads
the panels again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..native.build import CpuKernels, _cache_dir, whole_pages
from ..native.kept import KeptJson

log = logging.getLogger(__name__)

CACHE_ENV = "KILN_NATIVE_PANEL_CACHE"
# Bumped when the file's layout or what the index says changes.
FORMAT = 1
KEPT_FILES = 3

# (blocks, GGML type id, width) as CpuKernels.ggml_panels_many takes them, and what it gives.
Matrix = tuple[np.ndarray, int, int]
Panels = tuple[np.ndarray, int]


def _folder() -> Path | None:
    """Where panels are kept: ``KILN_NATIVE_PANEL_CACHE`` if it names a folder (an absolute
    path: the test suite keeps its own there), else ``<native cache>/panels``; None where it is
    turned off."""
    value = os.environ.get(CACHE_ENV, "1").strip()
    if value.lower() in ("0", "false", "no", "off"):
        return None
    return Path(value) if os.path.isabs(value) else _cache_dir() / "panels"


class PanelCache:
    """The kept panels of one GGUF file for one kernel build."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder = folder
        self.key = key
        self._index = KeptJson(folder)

    @classmethod
    def for_file(cls, path: Path, kernel: CpuKernels, folder: Path | None = None) -> PanelCache | None:
        """The cache of `path` with `kernel`'s build, in `folder` (default: ``_folder()``'s); None
        where it is turned off or the file cannot be identified."""
        default = _folder()
        if default is None:
            return None
        folder = folder or default
        library = getattr(kernel.library, "_name", None)
        try:
            resolved = path.resolve()
            st = resolved.stat()
        except OSError:
            return None
        ident = [str(resolved), st.st_size, st.st_mtime_ns, st.st_ino, os.path.basename(str(library)), FORMAT]
        return cls(folder, hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:24])

    @property
    def data_path(self) -> Path:
        return self.folder / f"{self.key}.panels"

    def mapped(self, matrices: Sequence[Matrix], kernel: CpuKernels) -> list[Panels | None] | None:
        """Each matrix's panels as views of the kept file (None for those it has none of), or
        None where no usable file is kept (then nothing is mapped)."""
        index = self._index.get(self.key)
        if index is None:
            return None
        entries = index.get("matrices")
        try:
            if not isinstance(entries, list) or len(entries) != len(matrices) or self.data_path.stat().st_size != index.get("size"):
                return None
            mapping = np.memmap(self.data_path, dtype=np.uint8, mode="r")
            results: list[Panels | None] = []
            for (blocks, type_id, k), entry in zip(matrices, entries, strict=True):
                if entry is None:
                    results.append(None)
                    continue
                kept_type, rows, width, panel_type, row_bytes, offset = entry
                expected = (type_id, blocks.shape[0], k, kernel.ggml_row_bytes(panel_type, k))
                if (kept_type, rows, width, row_bytes) != expected or offset + rows * row_bytes > mapping.size:
                    return None
                results.append((mapping[offset : offset + rows * row_bytes].reshape(rows, row_bytes), panel_type))
        except (OSError, ValueError, TypeError):
            return None
        if not self._agrees(matrices, results, kernel):
            log.warning("the panels kept in %s do not match the model file's rows: removed, reading them again", self.data_path)
            self._remove(self.key)
            return None
        try:
            os.utime(self.data_path)  # most recently used
        except OSError:
            pass
        return results

    def keep(self, matrices: Sequence[Matrix], panels: Sequence[Panels | None]) -> None:
        """Write `panels` (ggml_panels_many's, for `matrices`) for later starts, or log why not."""
        if not any(p is not None for p in panels):
            return
        started, tmp = time.perf_counter(), None
        entries: list[list[int] | None] = []
        offset = 0
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._evict()
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".panels.partial")
            with os.fdopen(fd, "wb") as fh:
                for (blocks, type_id, k), read in zip(matrices, panels, strict=True):
                    if read is None:
                        entries.append(None)
                        continue
                    array, panel_type = read
                    fh.seek(offset)
                    np.ascontiguousarray(array).tofile(fh)
                    entries.append([type_id, blocks.shape[0], k, panel_type, array.shape[1], offset])
                    offset += whole_pages(array.nbytes)
                fh.truncate(offset)
            os.replace(tmp, self.data_path)
            tmp = None
        except OSError as exc:
            log.info("could not keep the panels in %s: %s", self.folder, exc)
            if tmp is not None:
                _unlink(Path(tmp))
            return
        self._index.put(self.key, {"size": offset, "matrices": entries})
        log.info("kept %.0f MB of panels for later starts in %.1f s (%s)", offset / 1e6, time.perf_counter() - started, self.data_path)

    def _agrees(self, matrices: Sequence[Matrix], panels: Sequence[Panels | None], kernel: CpuKernels) -> bool:
        """Two rows each of the first, middle and last matrix with panels equal the file's."""
        present = [(matrix, read) for matrix, read in zip(matrices, panels, strict=True) if read is not None]
        picked = sorted({0, len(present) // 2, len(present) - 1}) if present else []
        for (blocks, type_id, k), (array, panel_type) in (present[i] for i in picked):
            rows = np.array([0, blocks.shape[0] - 1], dtype=np.int32)
            if kernel.ggml_dequantize(array, panel_type, k, rows).tobytes() != kernel.ggml_dequantize(blocks, type_id, k, rows).tobytes():
                return False
        return True

    def _evict(self) -> None:
        """Remove all but the most recent KEPT_FILES - 1 files (one is about to be written), and
        any partial file over an hour old (a start that died while writing)."""
        kept = sorted(self.folder.glob("*.panels"), key=_mtime, reverse=True)
        for path in kept[KEPT_FILES - 1 :]:
            self._remove(path.stem)
        for partial in self.folder.glob("*.partial"):
            if time.time() - _mtime(partial) > 3600:
                _unlink(partial)

    def _remove(self, key: str) -> None:
        _unlink(self.folder / f"{key}.json")
        _unlink(self.folder / f"{key}.panels")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
