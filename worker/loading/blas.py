"""Put OpenBLAS under mlx's Linux CPU build by re-executing with LD_PRELOAD.

mlx's Linux CPU wheel resolves `cblas_sgemm` & co. from the reference BLAS it
bundles (~6 GFLOP/s on a 576x576 fp32 matmul). An OpenBLAS preloaded at
process start wins symbol resolution and runs the same matmul at ~60-200
GFLOP/s. Loading OpenBLAS later (ctypes.CDLL with RTLD_GLOBAL) does not help:
mlx's library has already bound to its own copy. So the worker re-executes
itself once, before importing mlx, with LD_PRELOAD naming an OpenBLAS.

Not every OpenBLAS found on disk is usable, and a bad preload kills the
process before Python starts (missing libgfortran.so.5) or on the first matmul
(SIGILL: cmeel-openblas 0.3.31 is a SKYLAKEX-only build that uses AVX-512).
So each candidate is first tried in a throw-away interpreter that calls
`cblas_sgemm`; the first that works is used. OpenBLAS builds link
libgfortran.so.5; where the system has none, the copy numpy's wheel bundles is
exposed under that name through a small symlink folder on LD_LIBRARY_PATH.

This module must not import mlx (directly or indirectly).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger("kiln.worker.loading")

DISABLE_ENV = "KILN_NO_BLAS_PRELOAD"
# Set on the re-executed process so that it never re-executes again.
_MARKER_ENV = "KILN_BLAS_REEXEC"

# Distro packages (Debian/Ubuntu libopenblas0-pthread, Fedora, Arch): built
# with DYNAMIC_ARCH, so they run on any x86-64/arm64 CPU. Preferred.
_SYSTEM_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

# Calls cblas_sgemm through whatever the dynamic linker bound (the preload).
_PROBE = """
import ctypes, sys
lib = ctypes.CDLL(None)
n = 64
A = (ctypes.c_float * (n * n))(*([1.0] * (n * n)))
C = (ctypes.c_float * (n * n))()
lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
    ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
lib.cblas_sgemm(101, 111, 111, n, n, n, 1.0, A, n, A, n, 0.0, C, n)
sys.exit(0 if C[0] == n and C[n * n - 1] == n else 3)
"""


def _package_dir(name: str) -> Path | None:
    # find_spec does not import the package (ngsolve_openblas loads libraries on import).
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _site_dirs() -> list[Path]:
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    roots.update(p for p in sys.path if p.endswith("site-packages"))
    return [Path(root) for root in sorted(roots)]


def openblas_candidates() -> list[str]:
    """Existing OpenBLAS libraries, best first: distro, ngsolve-openblas, cmeel-openblas."""
    found: list[Path] = [Path(p) for p in _SYSTEM_CANDIDATES]
    ngsolve = _package_dir("ngsolve_openblas")
    if ngsolve is not None:
        found.extend(sorted(ngsolve.glob("libopenblas*.so*")))
    found.extend(site / "cmeel.prefix" / "lib" / "libopenblas.so.0" for site in _site_dirs())
    unique: list[str] = []
    for path in found:
        if path.is_file():
            resolved = str(path.resolve())
            if resolved not in unique:
                unique.append(resolved)
    return unique


def _has_system_gfortran() -> bool:
    try:
        ctypes.CDLL("libgfortran.so.5")
    except OSError:
        return False
    return True


def gfortran_shim_dir() -> str | None:
    """A folder holding `libgfortran.so.5` (numpy's bundled copy), or None.

    numpy's wheel renames its libgfortran (and the libquadmath it needs, found
    through $ORIGIN) with a hash; symlinks under the plain names let an
    OpenBLAS that links `libgfortran.so.5` load.
    """
    numpy_dir = _package_dir("numpy")
    if numpy_dir is None:
        return None
    libs = numpy_dir.parent / "numpy.libs"
    gfortran = sorted(libs.glob("libgfortran*.so*"))
    if not gfortran:
        return None
    for base in (Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")), Path(tempfile.gettempdir())):
        shim = base / "kiln" / f"gfortran-shim-{os.getuid()}"
        try:
            shim.mkdir(parents=True, exist_ok=True)
            _link(shim / "libgfortran.so.5", gfortran[0])
            for extra in libs.glob("libquadmath*.so*"):
                _link(shim / extra.name, extra)
            return str(shim)
        except OSError:
            continue
    return None


def _link(link: Path, target: Path) -> None:
    """Point `link` at `target`, atomically replacing a stale link."""
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)


def preloaded_openblas(env: Mapping[str, str] | None = None) -> bool:
    """True if LD_PRELOAD already names an OpenBLAS library."""
    preload = (env if env is not None else os.environ).get("LD_PRELOAD", "")
    return any("openblas" in Path(p).name for p in preload.replace(":", " ").split())


def preload_env(library: str, env: Mapping[str, str], lib_dir: str | None = None) -> dict[str, str]:
    """A copy of `env` with `library` first in LD_PRELOAD and threads defaulted.

    `lib_dir`, if given, is prepended to LD_LIBRARY_PATH (the gfortran shim).
    """
    new = dict(env)
    existing = new.get("LD_PRELOAD", "").strip()
    new["LD_PRELOAD"] = f"{library} {existing}".strip()
    if lib_dir:
        paths = [lib_dir, *[p for p in new.get("LD_LIBRARY_PATH", "").split(":") if p]]
        new["LD_LIBRARY_PATH"] = ":".join(paths)
    # The user's choice wins; otherwise use every core we may run on.
    new.setdefault("OPENBLAS_NUM_THREADS", str(_usable_cores()))
    new[_MARKER_ENV] = "1"
    return new


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def probe(env: Mapping[str, str], timeout: float = 20.0) -> bool:
    """Whether an interpreter started with `env` can run cblas_sgemm."""
    try:
        done = subprocess.run(
            [sys.executable, "-S", "-I", "-c", _PROBE],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def find_openblas() -> str | None:
    """Path of an OpenBLAS that really works when preloaded here, or None.

    Runs one short probe process per candidate until one succeeds.
    """
    usable = _usable_preload()
    return usable[0] if usable else None


def _usable_preload(env: Mapping[str, str] | None = None) -> tuple[str, dict[str, str]] | None:
    """The first working candidate and the environment (``env``, default this process's, with
    the preload added) that makes it work."""
    base = {k: v for k, v in (os.environ if env is None else env).items() if k != _MARKER_ENV}
    shim: str | None = None if _has_system_gfortran() else gfortran_shim_dir()
    for library in openblas_candidates():
        env = preload_env(library, base, shim)
        if probe(env):
            return library, env
        log.debug("OpenBLAS candidate %s failed its probe", library)
    return None


def should_reexec(env: Mapping[str, str] | None = None) -> bool:
    """Whether `reexec_with_openblas` would try to re-execute (before probing)."""
    env = os.environ if env is None else env
    return (
        sys.platform.startswith("linux")
        and not env.get(DISABLE_ENV)
        and not env.get(_MARKER_ENV)
        and not preloaded_openblas(env)
        and "mlx" not in sys.modules  # too late: mlx is already bound to its BLAS
    )


def with_openblas(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a worker about to be started, with the OpenBLAS that ``reexec_with_openblas``
    would preload already preloaded (and marked so), or ``env`` as it is where that would not act
    or finds none.

    Why: a supervisor that starts its workers this way saves each of them re-executing itself: a
    second interpreter start, and imports and a probe before it, ~0.2 s of every start.
    """
    if not should_reexec(env):
        return dict(env)
    found = _usable_preload(env)
    return found[1] if found is not None else dict(env)


def reexec_with_openblas(argv: Sequence[str] | None = None) -> None:
    """Re-execute this process with a working OpenBLAS preloaded; else return.

    Call at the very start of the entry point, before mlx is imported.
    `argv` is the full command line to re-run (argv[0] an executable); None or
    `sys.argv` re-runs the current interpreter with its original options
    (`python -m ...` included). Returns without doing anything off Linux, when
    KILN_NO_BLAS_PRELOAD is set, when LD_PRELOAD already holds an OpenBLAS,
    after a re-execution, or when no candidate passes its probe. On success it
    does not return.
    """
    if not should_reexec():
        return
    found = _usable_preload()
    if found is None:
        log.warning("no usable OpenBLAS found; mlx uses its slow reference BLAS on this CPU")
        return
    library, env = found
    if argv is None or list(argv) == sys.argv:
        args = _current_command()
    else:
        args = list(argv)
    log.info("re-executing with LD_PRELOAD=%s", library)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(args[0], args, env)
    except OSError as exc:
        log.warning("could not re-execute with OpenBLAS (%s); continuing without it", exc)


def _current_command() -> list[str]:
    """The command line that started this interpreter, runnable by execve.

    `sys.orig_argv` (3.10+) keeps the interpreter's own options and `-m mod`,
    which `sys.argv` loses.
    """
    orig = list(getattr(sys, "orig_argv", []) or [])
    if orig:
        return [sys.executable, *orig[1:]]
    return [sys.executable, *sys.argv]
