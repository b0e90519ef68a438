"""Put OpenBLAS under mlx's Linux CPU build by re-executing with LD_PRELOAD.

mlx's Linux CPU wheel resolves `cblas_sgemm` & co. from the reference BLAS it
bundles (~6 GFLOP/s on a 576x576 fp32 matmul). An OpenBLAS preloaded at
process start wins symbol resolution and runs the same matmul at ~170-200
GFLOP/s. Loading OpenBLAS later (ctypes.CDLL with RTLD_GLOBAL) does not help:
mlx's library has already bound to its own copy. So the worker re-executes
itself once, before importing mlx, with LD_PRELOAD naming an OpenBLAS.

This module must not import mlx (directly or indirectly).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Mapping, Sequence

log = logging.getLogger("kiln.worker.loading")

DISABLE_ENV = "KILN_NO_BLAS_PRELOAD"
# Set on the re-executed process so that a failed preload cannot loop.
_MARKER_ENV = "KILN_BLAS_REEXEC"

# Debian/Ubuntu packages (libopenblas0-pthread / -openmp / -serial) and other distros.
_SYSTEM_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def _site_candidates() -> list[Path]:
    """cmeel-openblas's library in every site-packages this interpreter uses."""
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    roots.update(p for p in sys.path if p.endswith("site-packages"))
    return [Path(root) / "cmeel.prefix" / "lib" / "libopenblas.so.0" for root in sorted(roots)]


def find_openblas() -> str | None:
    """Path of an OpenBLAS shared library with plain `cblas_*` symbols, or None.

    cmeel-openblas (a declared dependency on Linux) is preferred because it is
    present wherever Kiln is pip-installed; a distro OpenBLAS is the fallback.
    """
    for candidate in [*_site_candidates(), *map(Path, _SYSTEM_CANDIDATES)]:
        if candidate.is_file():
            return str(candidate)
    return None


def preloaded_openblas(env: Mapping[str, str] | None = None) -> bool:
    """True if LD_PRELOAD already names an OpenBLAS library."""
    preload = (env if env is not None else os.environ).get("LD_PRELOAD", "")
    return any("openblas" in Path(p).name for p in preload.replace(":", " ").split())


def preload_env(library: str, env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with `library` prepended to LD_PRELOAD and threads defaulted."""
    new = dict(env)
    existing = new.get("LD_PRELOAD", "").strip()
    new["LD_PRELOAD"] = f"{library} {existing}".strip() if existing else library
    # The user's choice wins; otherwise use every core we are allowed to run on.
    if "OPENBLAS_NUM_THREADS" not in new:
        new["OPENBLAS_NUM_THREADS"] = str(_usable_cores())
    new[_MARKER_ENV] = "1"
    return new


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def should_reexec(env: Mapping[str, str] | None = None) -> bool:
    """Whether `reexec_with_openblas` would re-execute (ignoring library presence)."""
    env = os.environ if env is None else env
    return (
        sys.platform.startswith("linux")
        and not env.get(DISABLE_ENV)
        and not env.get(_MARKER_ENV)
        and not preloaded_openblas(env)
        and "mlx" not in sys.modules  # too late: mlx is already bound to its BLAS
    )


def reexec_with_openblas(argv: Sequence[str] | None = None) -> None:
    """Re-execute this process with OpenBLAS preloaded, when useful; else return.

    Call at the very start of the worker's entry point, before mlx is imported.
    `argv` is the full command line to re-run, `argv[0]` being an executable
    (a path, or a name looked up on PATH); the default re-runs the current
    interpreter with its original options (`python -m ...` included). Returns without doing anything on
    non-Linux systems, when KILN_NO_BLAS_PRELOAD is set, when LD_PRELOAD
    already holds an OpenBLAS, or when no OpenBLAS is found. On success it
    does not return.
    """
    if not should_reexec():
        return
    library = find_openblas()
    if library is None:
        log.info("no OpenBLAS found; mlx will use its bundled reference BLAS (slow on CPU)")
        return
    args = list(argv) if argv is not None else _current_command()
    args[0] = shutil.which(args[0]) or args[0]
    log.info("re-executing with LD_PRELOAD=%s", library)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(args[0], args, preload_env(library, os.environ))


def _current_command() -> list[str]:
    """The command line that started this interpreter, runnable by execve.

    `sys.orig_argv` (3.10+) holds the interpreter's own options and `-m mod`,
    which `sys.argv` loses.
    """
    orig = list(getattr(sys, "orig_argv", []) or [])
    if orig:
        return [sys.executable, *orig[1:]]
    return [sys.executable, *sys.argv]
