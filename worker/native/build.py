"""Native CPU kernels, compiled on this machine at first use, for the instructions it has.

mlx's CPU backend has no fast quantized matmul, so decoding on the CPU from 4-bit weights
either runs mlx's scalar kernel or reads a float32 copy eight times the size. qmatmul.c
multiplies 1..8 rows straight against the packed weights; decode.c runs a whole decoder
forward pass (decode steps, short chunks) in one call. They are compiled here rather than
shipped as a wheel, and a C compiler is one a Linux machine usually has. Where none works the
worker keeps its float32 path and says so in the log.

Portable builds. ``-march=native`` is not used: on some virtual machines the CPU reports
instructions the hypervisor does not execute, and a build for them dies with SIGILL (llama.cpp's
own ``-march=native`` builds do on the development VMs). Instead each variant has explicit
flags (AVX-512 + VNNI, AVX-VNNI, AVX2 + FMA, and the compiler's baseline; Arm dotprod and
baseline), and the first one that this CPU runs is taken: skipped unless /proc/cpuinfo lists its
instructions, then run once in a throw-away process (``kiln_selftest``: a CPUID check and one
product of each kind) so that an illegal instruction kills that process, not the worker.
``KILN_NATIVE_PORTABLE=1`` takes the baseline build whatever the CPU has (tests use it);
``KILN_NATIVE_VARIANT=avx2`` (any variant's name) starts the search at that build, so that one
machine can show what a CPU without the faster extensions gets (bench/'s ``--cpu avx2``).

Each shared library is cached under ``$KILN_NATIVE_CACHE`` (default ``~/.cache/kiln/native``),
named by a hash of the sources, the compiler command and the CPU, so an edit or another machine
builds afresh. ``KILN_NATIVE_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from .threads import TeamSize

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCE = HERE / "decode.c"  # includes qmatmul.c, ggml.c, panels.c, gemm.c and attention.c
SOURCES = (HERE / "qmatmul.c", HERE / "ggml.c", HERE / "panels.c", HERE / "gemm.c", HERE / "attention.c", SOURCE)
DISABLE_ENV = "KILN_NATIVE_KERNELS"
X16 = 0x100  # or'ed into a GGML type id: the matrix in panels of 16 rows (panels.c)
CACHE_ENV = "KILN_NATIVE_CACHE"
PORTABLE_ENV = "KILN_NATIVE_PORTABLE"
VARIANT_ENV = "KILN_NATIVE_VARIANT"
# Every variant's code generation flags, then those that make it a shared library (separate
# so that tests/worker/native_driver.c can be built as a program with exactly the same code).
COMPILE_FLAGS = ("-O3", "-std=gnu11", "-fopenmp", "-fno-math-errno", "-Wno-psabi")
_LIBRARY_FLAGS = ("-shared", "-fPIC")


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its name, compiler flags, and the /proc/cpuinfo flags it needs."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]


_X86 = (
    Variant("avx512vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"), frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"})),
    Variant("avxvnni", ("-march=x86-64-v3", "-mavxvnni", "-mtune=generic"), frozenset({"avx_vnni", "avx2", "fma", "f16c"})),
    Variant("avx2", ("-march=x86-64-v3", "-mtune=generic"), frozenset({"avx2", "fma", "f16c"})),
)
_ARM = (Variant("dotprod", ("-march=armv8.2-a+dotprod",), frozenset({"asimddp"})),)
PORTABLE = Variant("portable", (), frozenset())


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """This architecture's builds (or those of ``machine``, as platform.machine() names it),
    fastest first, the portable one last."""
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return (*_X86, PORTABLE)
    if machine in ("aarch64", "arm64"):
        return (*_ARM, PORTABLE)
    return (PORTABLE,)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class CpuKernels:
    """The compiled functions of qmatmul.c, called through ctypes (the GIL is released)."""

    def __init__(self, library: ctypes.CDLL, variant: str, threads: int = 1, threads_fixed: bool = True) -> None:
        self._lib = library
        self.variant = variant  # which build: "avx512vnni", "avx2", "portable", ...
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        library.kiln_qmm.argtypes = [i32] * 5 + [ptr] * 6
        library.kiln_qmm.restype = i32
        library.kiln_qmm_max_rows.restype = i32
        library.kiln_forward.argtypes = [ptr, ptr, i32, i32, ptr, ptr, ptr, i32, i32, i32, ptr, ptr]
        library.kiln_forward.restype = i32
        library.kiln_forward_work.argtypes = [ptr, i32, i32]
        library.kiln_forward_work.restype = i64
        library.kiln_set_threads.argtypes = [i32]
        library.kiln_set_threads.restype = None
        self.max_rows: int = library.kiln_qmm_max_rows()
        # Whether this build has 8-bit activations with integer dot products (else float32).
        self.int8: bool = bool(library.kiln_has_int8())
        # Whether this build multiplies prompt-sized chunks by GGUF blocks with its GEMM (gemm.c).
        self.gemm: bool = bool(library.kiln_has_gemm())
        # Whether this build multiplies Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 matrices re-laid in panels of 16 rows (panels.c):
        # the AVX-512 VNNI and AVX-VNNI builds.
        self.panels: bool = bool(library.kiln_has_panels())
        library.kiln_ggml_pack_x16_many.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, ptr]
        library.kiln_ggml_pack_x16_many.restype = None
        library.kiln_set_parallel_macs.argtypes = [i64]
        if os.environ.get("KILN_NATIVE_PARALLEL_MACS"):
            library.kiln_set_parallel_macs(int(os.environ["KILN_NATIVE_PARALLEL_MACS"]))
        library.kiln_threads.restype = i32
        library.kiln_ggml_matmul.argtypes = [i32, i32, i32, i32, ptr, ptr, ptr]
        library.kiln_ggml_matmul.restype = i32
        library.kiln_ggml_gemm.argtypes = [i32, i32, i32, i32, ptr, ptr, ptr]
        library.kiln_ggml_gemm.restype = i32
        library.kiln_ggml_matmul_f32.argtypes = [i32, i32, i32, i32, ptr, ptr, ptr]
        library.kiln_ggml_matmul_f32.restype = i32
        library.kiln_ggml_dequant.argtypes = [i32, i32, i32, ptr, ptr, ptr]
        library.kiln_ggml_dequant.restype = None
        library.kiln_ggml_row_bytes.argtypes = [i32, i64]
        library.kiln_ggml_row_bytes.restype = i64
        # The forward pass's team: all `threads`, or one where that measures faster (threads.py).
        self.team = TeamSize(threads, self.set_threads, threads_fixed)
        self._owner: int | None = None  # the thread whose passes use the team (claim_team)
        self._alone = threading.local()  # .set: this other thread's passes already run on one

    def set_threads(self, n: int) -> None:
        """Use n threads for the calling thread's parallel loops from now on."""
        self._lib.kiln_set_threads(n)

    def claim_team(self) -> None:
        """Make the calling thread the one whose passes run on the whole team; every other
        thread's passes run on one thread.

        Why: libgomp keeps a pool of threads for each thread that opens a parallel region, and
        once it manages more threads than the process has cores it throttles all of them: their
        barriers stop spinning and sleep in the kernel almost at once. The decode step meets at
        about ten barriers a layer, and with a second pool (the worker's main thread had run
        products while loading, the engine thread ran the steps) a one-row SmolLM2 step took
        about twice as long on two threads, as slow as on one. So exactly one thread, the
        engine's, opens teams of more than one; loading, tests and other callers compute alone.
        """
        self._owner = threading.get_ident()
        self._alone.set = False
        self.set_threads(self.team.current)

    def threads_here(self) -> int:
        """The team size the calling thread's next pass uses."""
        self.enter()
        return int(self._lib.kiln_threads())

    def enter(self) -> None:
        """Before a pass on the calling thread: a thread that does not own the team runs its
        passes on one thread (claim_team says why)."""
        if threading.get_ident() != self._owner and not getattr(self._alone, "set", False):
            self._lib.kiln_set_threads(1)
            self._alone.set = True

    @contextmanager
    def forward_pass(self, tokens: int) -> Iterator[None]:
        """Around one forward pass of ``tokens`` tokens: the owner's team size follows the
        measurements (threads.py); another thread's pass runs on one thread."""
        if threading.get_ident() == self._owner:
            with self.team.step(tokens):
                yield
        else:
            self.enter()
            yield

    @property
    def library(self) -> ctypes.CDLL:
        """The loaded library, for callers that pass it C structs (engine/native_decode.py)."""
        return self._lib

    def matmul(self, x: np.ndarray, q: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int) -> np.ndarray:
        """``x @ dequantize(q, scales, biases).T``. x: (M, K) float32 C-contiguous, M <= max_rows;
        q: (N, K * bits / 8) uint8; scales, biases: (N, K / group_size) float16."""
        rows, k = x.shape
        n = q.shape[0]
        y = np.empty((rows, n), dtype=np.float32)
        work = np.empty(rows * k, dtype=np.float32)
        self.enter()
        status = self._lib.kiln_qmm(
            bits, rows, n, k, group_size,
            q.ctypes.data, scales.ctypes.data, biases.ctypes.data, x.ctypes.data, y.ctypes.data, work.ctypes.data,
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"kiln_qmm cannot multiply {rows}x{k} by {bits}-bit {n}x{k} (group {group_size})")
        return y


    def ggml_row_bytes(self, type_id: int, k: int) -> int:
        """Bytes of one row of k weights of GGML type ``type_id``, or -1 where the kernels do not
        read that type (or k is not a whole number of its blocks)."""
        return int(self._lib.kiln_ggml_row_bytes(type_id, k))

    def ggml_panels(self, blocks: np.ndarray, type_id: int, k: int) -> tuple[np.ndarray, int] | None:
        """A GGUF matrix's blocks re-laid in panels of 16 rows (panels.c) and the type id they
        are read as, or None where this build has no loops for them, the type has no panels or
        the rows are not a multiple of 16. The panels are a new array; ``blocks`` is only read."""
        return self.ggml_panels_many([(blocks, type_id, k)])[0]

    def ggml_panels_many(self, matrices: Sequence[tuple[np.ndarray, int, int]]) -> list[tuple[np.ndarray, int] | None]:
        """``ggml_panels`` of each (blocks, type id, k), all read in one native call into one new
        mapping (each matrix a page-aligned view of it): see kiln_ggml_pack_x16_many for why."""
        results: list[tuple[np.ndarray, int] | None] = [None] * len(matrices)
        if not self.panels:
            return results
        planned: list[tuple[int, int, int]] = []  # (index, panel row bytes, offset)
        total = 0
        for i, (blocks, type_id, k) in enumerate(matrices):
            n = blocks.shape[0]
            row_bytes = self.ggml_row_bytes(type_id | X16, k)
            if n % 16 or row_bytes < 0 or self.ggml_row_bytes(type_id, k) != blocks.shape[1] or not blocks.flags.c_contiguous:
                continue
            planned.append((i, row_bytes, total))
            total += whole_pages(n * row_bytes)
        if not planned:
            return results
        region = _populated(total)
        views = [region[off : off + matrices[i][0].shape[0] * rb].reshape(matrices[i][0].shape[0], rb) for i, rb, off in planned]
        types = np.array([matrices[i][1] for i, _, _ in planned], dtype=np.int32)
        rows = np.array([matrices[i][0].shape[0] for i, _, _ in planned], dtype=np.int32)
        widths = np.array([matrices[i][2] for i, _, _ in planned], dtype=np.int32)
        sources = np.array([matrices[i][0].ctypes.data for i, _, _ in planned], dtype=np.uintp)
        targets = np.array([v.ctypes.data for v in views], dtype=np.uintp)
        made = np.empty(len(planned), dtype=np.int32)
        self.enter()
        self._lib.kiln_ggml_pack_x16_many(len(planned), types.ctypes.data, rows.ctypes.data, widths.ctypes.data, sources.ctypes.data, targets.ctypes.data, made.ctypes.data)
        for (i, _, _), view, type_id, got in zip(planned, views, types, made, strict=True):
            if got == type_id | X16:
                results[i] = (view, int(got))
        return results

    def ggml_matmul(self, x: np.ndarray, blocks: np.ndarray, type_id: int, k: int, exact: bool = False) -> np.ndarray:
        """``x @ W.T`` for W stored as a GGUF's blocks of ``type_id`` (rows x row bytes, uint8),
        with 8-bit activations and integer dot products, or (``exact``) float32 activations
        against W dequantized in registers (ggml.c). x: (M, k) float32 C-contiguous, any M."""
        rows = x.shape[0]
        n = blocks.shape[0]
        if self.ggml_row_bytes(type_id, k) != blocks.shape[1] or x.shape[1] != k or not blocks.flags.c_contiguous:
            raise ValueError(f"GGML type {type_id} blocks of shape {blocks.shape} do not hold {k}-wide rows")
        y = np.empty((rows, n), dtype=np.float32)
        self.enter()
        product = self._lib.kiln_ggml_matmul_f32 if exact else self._lib.kiln_ggml_matmul
        if product(type_id, rows, n, k, blocks.ctypes.data, x.ctypes.data, y.ctypes.data) != 0:
            raise MemoryError("kiln_ggml_matmul could not allocate its activations")
        return y

    def ggml_gemm(self, x: np.ndarray, blocks: np.ndarray, type_id: int, k: int) -> np.ndarray:
        """``x @ W.T`` as a prefill chunk's products compute it (gemm.c where the build has it,
        else the same 8-bit product as ``ggml_matmul``). x: (M, k) float32 C-contiguous."""
        rows = x.shape[0]
        n = blocks.shape[0]
        if self.ggml_row_bytes(type_id, k) != blocks.shape[1] or x.shape[1] != k or not blocks.flags.c_contiguous:
            raise ValueError(f"GGML type {type_id} blocks of shape {blocks.shape} do not hold {k}-wide rows")
        y = np.empty((rows, n), dtype=np.float32)
        self.enter()
        if self._lib.kiln_ggml_gemm(type_id, rows, n, k, blocks.ctypes.data, x.ctypes.data, y.ctypes.data) != 0:
            raise MemoryError("kiln_ggml_gemm could not allocate its activations")
        return y

    def ggml_dequantize(self, blocks: np.ndarray, type_id: int, k: int, rows: np.ndarray | None = None) -> np.ndarray:
        """Rows of W (all, or those ``rows`` names) as float32, bit-exact with gguf-py's
        dequantize."""
        if self.ggml_row_bytes(type_id, k) != blocks.shape[1] or not blocks.flags.c_contiguous:
            raise ValueError(f"GGML type {type_id} blocks of shape {blocks.shape} do not hold {k}-wide rows")
        picked = None if rows is None else np.ascontiguousarray(rows, dtype=np.int32)
        if picked is not None and picked.size and (picked.min() < 0 or picked.max() >= blocks.shape[0]):
            raise IndexError("row index out of range")
        n = blocks.shape[0] if picked is None else picked.size
        out = np.empty((n, k), dtype=np.float32)
        self.enter()
        self._lib.kiln_ggml_dequant(type_id, n, k, blocks.ctypes.data, None if picked is None else picked.ctypes.data, out.ctypes.data)
        return out


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> tuple[str, set[str] | None]:
    """The CPU's flags line from /proc/cpuinfo (for the cache key) and its set of flags, or
    None where there is no such file (then every variant is tried by running it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line, set(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return platform.processor(), None


# madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14); Python 3.11's mmap module does not name it.
_MADV_POPULATE_WRITE = 23


def whole_pages(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages: where the next matrix starts in a mapping of panels."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _populated(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 array of `nbytes` whose pages are all faulted in by one call.

    Why: the pack loop wrote a 1B file's 680 MB of panels into pages faulted one at a time, 0.2 s
    of a start in 4 KB pages; MADV_POPULATE_WRITE maps them in 0.14-0.15 s. Not 2 MB pages:
    asked for with MADV_HUGEPAGE (the last version of this, which mapped shared memory, where this
    kernel never gives them), this VM took 0.1 to 0.9 s for them from one start to the next, and
    the decode figures were all measured on 4 KB pages. A kernel without the call (EINVAL) faults
    the pages in as they are written."""
    if nbytes < 4 << 20 or not hasattr(mmap, "MAP_PRIVATE"):
        return np.empty(nbytes, dtype=np.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        pass
    return np.frombuffer(region, dtype=np.uint8)


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "kiln", "native")
    return Path(root)


def _build(compiler: str, variant: Variant) -> Path:
    flags = [*COMPILE_FLAGS, *_LIBRARY_FLAGS, *variant.flags]
    parts = [*(src.read_bytes() for src in SOURCES), compiler.encode(), " ".join(flags).encode(), platform.machine().encode(), _cpu_flags()[0].encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = _cache_dir() / f"kiln-{variant.name}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: two workers starting together never load a half-written file.
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        started = time.perf_counter()
        log.info("compiling the native CPU kernels (%s) into %s", variant.name, target)
        subprocess.run([compiler, *flags, str(SOURCE), "-o", partial], check=True, capture_output=True, timeout=300)
        os.replace(partial, target)
        log.info("compiled the native CPU kernels (%s) in %.1f s", variant.name, time.perf_counter() - started)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _runs_here(library: Path) -> bool:
    """Whether this CPU executes the library's instructions: its self-test, run in a child
    process (an illegal instruction kills the child). The verdict is kept beside the library,
    whose name already depends on the CPU."""
    verdict = library.with_suffix(".ok")
    if verdict.is_file():
        return True
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).kiln_selftest())"
    try:
        done = subprocess.run([sys.executable, "-c", probe, str(library)], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    if done.returncode != 0:
        log.info("native kernels %s do not run on this CPU (self-test exit %s)", library.name, done.returncode)
        return False
    verdict.touch()
    return True


def _candidates() -> list[Variant]:
    """The variants worth trying here, fastest first."""
    if _truthy(PORTABLE_ENV):
        return [PORTABLE]
    _, flags = _cpu_flags()
    usable = [v for v in variants() if flags is None or v.needs <= flags]
    named = os.environ.get(VARIANT_ENV, "").strip().lower()
    if named:
        names = [v.name for v in usable]
        if named in names:
            return usable[names.index(named):]
        log.warning("%s=%s: not a build this CPU runs (%s); choosing as usual", VARIANT_ENV, named, ", ".join(names))
    return usable


def claim_team() -> None:
    """The calling thread (the engine's) runs the kernels' passes on the whole team from now
    on, others on one thread (CpuKernels.claim_team says why); nothing where the kernels are not
    loaded (this builds nothing)."""
    if cpu_kernels.cache_info().currsize:
        kernels = cpu_kernels()
        if kernels is not None:
            kernels.claim_team()


@lru_cache(maxsize=1)
def cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None where they are turned off or cannot be built on this machine."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: decoding quantized models on the CPU from float32 copies")
        return None
    # libgomp reads its thread count once, when loaded: one thread per core this process may use.
    fixed = "OMP_NUM_THREADS" in os.environ
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    try:
        threads = max(1, int(os.environ["OMP_NUM_THREADS"].split(",")[0]))
    except ValueError:
        threads, fixed = 1, True
    failure = ""
    for variant in _candidates():
        try:
            library = _build(compiler, variant)
            if not _runs_here(library):
                continue
            kernels = CpuKernels(ctypes.CDLL(str(library)), variant.name, threads, fixed)
            log.info("native CPU kernels: %s build, %s activations", variant.name, "8-bit" if kernels.int8 else "float32")
            return kernels
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # RuntimeError: no home directory
            detail = getattr(e, "stderr", b"") or b""
            failure = f"{e} {detail.decode(errors='replace')[-500:]}"
    log.warning("native CPU kernels unavailable (%s): decoding from float32 copies", failure or "no build runs on this CPU")
    return None
