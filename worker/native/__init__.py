"""Native CPU kernels, compiled on this machine at first use.

mlx's CPU backend has no fast quantized matmul, so decoding on the CPU from 4-bit weights
either runs mlx's scalar kernel or reads a float32 copy eight times the size. qmatmul.c
multiplies 1..8 rows straight against the packed weights. It is compiled here, with
``-march=native``, rather than shipped as a wheel: the loops are only fast when built for
the CPU they run on, and a C compiler is one a Linux machine usually has. Where none works
the worker keeps its float32 path and says so in the log.

The shared library is cached under ``$KILN_NATIVE_CACHE`` (default ``~/.cache/kiln/native``),
named by a hash of the source, the compiler command and the CPU, so an edit or another
machine builds afresh. ``KILN_NATIVE_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul.c")
DISABLE_ENV = "KILN_NATIVE_KERNELS"
CACHE_ENV = "KILN_NATIVE_CACHE"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]


class CpuKernels:
    """The compiled functions of qmatmul.c, called through ctypes (the GIL is released)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        library.kiln_qmm.argtypes = [i32] * 5 + [ptr] * 6
        library.kiln_qmm.restype = i32
        library.kiln_qmm_max_rows.restype = i32
        library.kiln_attention.argtypes = [i32] * 5 + [ptr, ptr, i64, i64, ptr, i64, i64, ptr, ctypes.c_float, ptr, ptr]
        library.kiln_attention.restype = None
        self.max_rows: int = library.kiln_qmm_max_rows()
        library.kiln_set_parallel_macs.argtypes = [i64]
        if os.environ.get("KILN_NATIVE_PARALLEL_MACS"):
            library.kiln_set_parallel_macs(int(os.environ["KILN_NATIVE_PARALLEL_MACS"]))

    def matmul(self, x: np.ndarray, q: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int) -> np.ndarray:
        """``x @ dequantize(q, scales, biases).T``. x: (M, K) float32 C-contiguous, M <= max_rows;
        q: (N, K * bits / 8) uint8; scales, biases: (N, K / group_size) float16."""
        rows, k = x.shape
        n = q.shape[0]
        y = np.empty((rows, n), dtype=np.float32)
        work = np.empty(rows * k, dtype=np.float32)
        status = self._lib.kiln_qmm(
            bits, rows, n, k, group_size,
            q.ctypes.data, scales.ctypes.data, biases.ctypes.data, x.ctypes.data, y.ctypes.data, work.ctypes.data,
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"kiln_qmm cannot multiply {rows}x{k} by {bits}-bit {n}x{k} (group {group_size})")
        return y

    @staticmethod
    def _readable(a: np.ndarray) -> tuple[np.ndarray, int, int]:
        """A (B, KVH, S, D) view the kernel reads in place (float32, each key a contiguous run,
        keys one after another), copied only if it is not one; with its row and head strides
        in floats."""
        if a.dtype != np.float32 or a.strides[3] != 4 or a.strides[2] != 4 * a.shape[3]:
            a = np.ascontiguousarray(a, dtype=np.float32)
        return a, a.strides[0] // 4, a.strides[1] // 4

    def attention(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: np.ndarray, scale: float) -> np.ndarray:
        """One-token attention (see kiln_attention). q: (B, H, D); keys/values: (B, KVH, S, D)
        views of the cache; start: (B,) first real key per row. Returns (B, H, D)."""
        keys, *k_strides = self._readable(keys)
        values, *v_strides = self._readable(values)
        rows, heads, dims = q.shape
        q = np.ascontiguousarray(q, dtype=np.float32)
        start = np.ascontiguousarray(start, dtype=np.int32)
        out = np.empty_like(q)
        work = np.empty(rows * heads * keys.shape[2], dtype=np.float32)
        self._lib.kiln_attention(
            rows, heads, keys.shape[1], dims, keys.shape[2], q.ctypes.data,
            keys.ctypes.data, *k_strides, values.ctypes.data, *v_strides,
            start.ctypes.data, scale, out.ctypes.data, work.ctypes.data,
        )  # fmt: skip
        return out


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "kiln", "native")
    return Path(root)


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(_FLAGS).encode(), platform.machine().encode(), _cpu_signature().encode()]))
    target = _cache_dir() / f"qmatmul-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: two workers starting together never load a half-written file.
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        started = time.perf_counter()
        log.info("compiling the native CPU kernels for this machine into %s", target)
        subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", partial], check=True, capture_output=True, timeout=120)
        os.replace(partial, target)
        log.info("compiled the native CPU kernels in %.1f s", time.perf_counter() - started)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@lru_cache(maxsize=1)
def cpu_kernels() -> CpuKernels | None:
    """The compiled kernel, or None where it is turned off or cannot be built on this machine."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: decoding quantized models on the CPU from float32 copies")
        return None
    # libgomp reads its thread count once, when loaded: one thread per core this process may use.
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    try:
        return CpuKernels(ctypes.CDLL(str(_build(compiler))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # RuntimeError: no home directory
        detail = getattr(e, "stderr", b"") or b""
        log.warning("native CPU kernels unavailable (%s %s): decoding from float32 copies", e, detail.decode(errors="replace")[-500:])
        return None
