"""Build llama.cpp's `llama-server` for this CPU, once, so that bench/ can run it as a peer.

    python -m bench.llama_cpp [--version 0.3.36] [--jobs 2] [--force]   # prints the binary's path

Where the sources come from: the llama.cpp tree vendored in PyPI's `llama-cpp-python` sdist
(`pip download --no-binary :all: --no-deps llama-cpp-python==VERSION`). A pinned PyPI release is
reachable wherever pip is, names one llama.cpp revision, and needs neither git nor GitHub.

Why explicit CPU flags: a `GGML_NATIVE` build (`-march=native`) lets the compiler use every
extension the CPU reports, and Xeon VMs report AMX that a process may not execute: such a build
dies with SIGILL. So the build turns `GGML_NATIVE` off and sets each of ggml's x86 options
(SSE4.2, AVX, AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX-512 F/CD/VL/DQ/BW, VBMI, VNNI, BF16) on exactly
when /proc/cpuinfo lists the instructions it compiles to; AMX stays off. On arm64 it names an
`-march` with the dot-product, fp16 and int8-matmul extensions the CPU lists.

Only the `llama-server` and `llama-quantize` targets are built (static libraries, no web UI, no
HTTPS, nothing fetched at build time), with `-j2` by default (minutes on 2 cores; progress lines go
to stderr). `llama-quantize` (bench/model_shapes.py's quantizer) shares every library with the
server, so building it beside the server costs one more source file; a folder that has only the
server builds the missing tool in the kept build folder, or unpacks the sources again. The
results are cached under `~/.cache/kiln-bench/llama.cpp/<version>-<hash>/` (the hash
covers the CMake options, so the CPU flags, and the compilers), next to `build.json` (what was
built and how) and `build.log`. An interrupted build resumes where it stopped (sources and build
folder are kept until the binary is cached, then removed); a finished one is reused by every later run, and by anyone who wants the same binary (the path is printed).
Every binary is probed (`llama-server --version`) before use.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .convert import cache_root

DEFAULT_VERSION = "0.3.36"
DEFAULT_JOBS = 2
PACKAGE = "llama-cpp-python"
# The programs built and cached in one folder: the peer server, and the quantizer of the
# model-shape files (bench/model_shapes.py), from the same sources and options.
TOOLS = ("llama-server", "llama-quantize")

# ggml's x86 options and the /proc/cpuinfo flags their compiler switches need (ggml-cpu's
# CMakeLists maps GGML_AVX512 to -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw).
X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
_NEEDS_AVX512 = ("GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16")
# Reported by Sapphire Rapids VMs but not usable without a permission the process never asks
# for: the reason -march=native builds die with SIGILL. Never turned on.
X86_NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")

# What every build sets, whatever the CPU: one self-contained binary, nothing downloaded while
# building (the web UI would come from a Hugging Face bucket), no optional system libraries.
BASE_OPTIONS: dict[str, str] = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",
    "GGML_NATIVE": "OFF",
    "GGML_CCACHE": "OFF",
    "GGML_BLAS": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_OPENSSL": "OFF",
}


class BuildError(RuntimeError):
    """llama-server could not be fetched, built or probed here; the message says why."""


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] llama.cpp: {msg}", file=sys.stderr, flush=True)


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags: x86 `flags`, arm64 `Features` (first processor's line)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


# `--cpu avx2`: build as for a CPU with AVX2 and neither AVX-VNNI nor AVX-512 (AMD's before Zen 4,
# Intel's client cores before Alder Lake), on one that has them, so that bench/ can compare
# Kiln's and llama.cpp's AVX2 code on the machine it has. "native": every extension listed.
CPU_LEVELS = ("native", "avx2")


def level_flags(flags: set[str], level: str) -> set[str]:
    """`flags` as a CPU of `level` (one of CPU_LEVELS) would list them."""
    if level not in CPU_LEVELS:
        raise ValueError(f"unknown CPU level {level!r}; choose from {', '.join(CPU_LEVELS)}")
    if level == "avx2":
        return {f for f in flags if not f.startswith(("avx512", "amx")) and f != "avx_vnni"}
    return flags


def cpu_options(flags: set[str], machine: str | None = None) -> dict[str, str]:
    """ggml's instruction-set options for a CPU with `flags`, each set explicitly."""
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        opts = {name: "ON" if all(f in flags for f in needs) else "OFF" for name, needs in X86_OPTIONS}
        if opts["GGML_AVX512"] == "OFF":
            opts.update(dict.fromkeys(_NEEDS_AVX512, "OFF"))
        opts.update(dict.fromkeys(X86_NEVER, "OFF"))
        return opts
    if machine in ("aarch64", "arm64"):
        ext = [e for e, f in (("dotprod", "asimddp"), ("fp16", "asimdhp"), ("i8mm", "i8mm")) if f in flags]
        return {"GGML_CPU_ARM_ARCH": ("armv8.2-a" if ext else "armv8-a") + "".join("+" + e for e in ext)}
    return {}  # other CPUs: ggml's portable defaults with GGML_NATIVE off


def describe(options: dict[str, str]) -> str:
    """The CPU options in a few words, e.g. `AVX2 FMA F16C BMI2 AVX512 AVX512_VNNI`."""
    on = [k.removeprefix("GGML_") for k, v in options.items() if k.startswith("GGML_") and v == "ON" and k not in BASE_OPTIONS]
    arm = options.get("GGML_CPU_ARM_ARCH")
    return arm or " ".join(on) or "portable"


def _first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""


@dataclass(frozen=True)
class Plan:
    """One build: the release, the CMake options, the tools; `key` names its cache folder."""

    version: str
    options: dict[str, str]
    cmake: str
    generator: str  # "Ninja" or "Unix Makefiles"
    compilers: tuple[str, str]

    @property
    def key(self) -> str:
        ident = json.dumps({"version": self.version, "options": self.options, "compilers": self.compilers, "machine": platform.machine()}, sort_keys=True)
        return f"{self.version}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"

    @property
    def folder(self) -> Path:
        return cache_root() / "llama.cpp" / self.key

    @property
    def binary(self) -> Path:
        return self.tool("llama-server")

    def tool(self, name: str) -> Path:
        """Where the cached build of program `name` (one of TOOLS) lives."""
        return self.folder / name


def _find_cmake() -> str | None:
    """cmake on PATH, else the PyPI `cmake` package's next to this interpreter."""
    found = shutil.which("cmake")
    if found:
        return found
    beside = Path(sys.executable).with_name("cmake")
    return str(beside) if beside.is_file() else None


def plan(version: str = DEFAULT_VERSION, cpu: str = "native") -> Plan:
    cmake = _find_cmake()
    if cmake is None:
        raise BuildError("cmake not found: install it (apt install cmake, or .venv/bin/pip install cmake) to build llama-server")
    cc, cxx = os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")
    if not shutil.which(cc) or not shutil.which(cxx):
        raise BuildError(f"no C/C++ compiler ({cc}, {cxx}) to build llama-server: install one (apt install g++)")
    generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
    options = {**BASE_OPTIONS, **cpu_options(level_flags(cpu_flags(), cpu)), "LLAMA_BUILD_COMMIT": f"{PACKAGE}-{version}"}
    return Plan(version, options, cmake, generator, (_first_line([cc, "--version"]), _first_line([cxx, "--version"])))


def probe(binary: Path | str, timeout: float = 60.0) -> str:
    """Run `binary --version`; return its version (`0.5.0-dev (build 0, commit ...)`) or raise BuildError (SIGILL included)."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{binary} --version failed: {exc}") from exc
    text = (out.stdout + out.stderr).strip()
    if out.returncode < 0:
        raise BuildError(f"{binary} --version died with signal {-out.returncode} (SIGILL means it was built for instructions this CPU lacks)")
    if out.returncode != 0 or "version" not in text:
        raise BuildError(f"{binary} --version exited {out.returncode}: {text[-300:]}")
    return next(line for line in text.splitlines() if "version" in line).strip().removeprefix("version:").strip()


@contextlib.contextmanager
def _locked(path: Path, timeout: float = 3 * 3600.0) -> Iterator[None]:
    """Hold an exclusive lock on `path`, so that two bench runs never build into one folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        deadline = time.monotonic() + timeout
        waiting = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    say(f"waiting for another process building into {path.parent} ...")
                    waiting = True
                if time.monotonic() > deadline:
                    raise BuildError(f"gave up waiting {timeout:.0f} s for the lock {path}") from None
                time.sleep(2.0)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sdist(version: str) -> Path:
    """The llama-cpp-python sdist for `version`, downloaded once into the shared cache."""
    folder = cache_root() / "llama.cpp" / "sdist"
    name = f"llama_cpp_python-{version}.tar.gz"
    if (folder / name).is_file():
        return folder / name
    folder.mkdir(parents=True, exist_ok=True)
    say(f"downloading the {PACKAGE}=={version} sdist with pip (about 75 MB) ...")
    argv = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", f"{PACKAGE}=={version}", "-d", str(folder)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"pip download {PACKAGE}=={version} failed: {exc}") from exc
    if out.returncode != 0 or not (folder / name).is_file():
        raise BuildError(f"pip download {PACKAGE}=={version} failed ({out.returncode}): {(out.stderr or out.stdout)[-500:]}")
    return folder / name


def _extract(archive: Path, dest: Path) -> None:
    """Unpack only `*/vendor/llama.cpp/` from the sdist into `dest` (atomically: tmp, rename)."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    marker = "/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            head, sep, rest = m.name.partition(marker)
            if sep and "/" not in head and rest:
                m.name = rest
                if m.islnk():  # hard links name their target by its archive path
                    m.linkname = m.linkname.partition(marker)[2]
                members.append(m)
        if not members:
            raise BuildError(f"{archive.name} holds no vendor/llama.cpp/ tree")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp, members=members, filter="data")
        else:  # Python < 3.10.12 / 3.11.4: no filters; the names were checked above
            tar.extractall(tmp, members=[m for m in members if not m.name.startswith("/") and ".." not in m.name.split("/")])
    tmp.rename(dest)


_STEP = re.compile(r"^\[\s*(\d+)/(\d+)\]|^\[\s*(\d+)%\]")


def _run_logged(argv: list[str], log: Path, what: str, report: Callable[[str], None] = say) -> None:
    """Run `argv`, appending its output to `log`; report progress every 5 % (or 30 s)."""
    report(f"{what}: {' '.join(argv[:3])} ... (log {log})")
    last_pct, last_time = -5, time.monotonic()
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(argv)}\n")
        fh.flush()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            m = _STEP.match(line)
            if not m:
                continue
            pct = int(m[3]) if m[3] else (100 * int(m[1]) // max(1, int(m[2])))
            now = time.monotonic()
            if pct >= last_pct + 5 or now - last_time > 30:
                step = f" ({m[1]}/{m[2]})" if m[1] else ""
                report(f"{what}: {pct}%{step}")
                last_pct, last_time = pct, now
        rc = proc.wait()
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise BuildError(f"{what} failed ({rc}); log {log}:\n" + "\n".join(tail))


def probe_tool(binary: Path) -> None:
    """Run a llama.cpp tool without arguments (it prints its usage): raise BuildError if a signal
    (SIGILL: built for instructions this CPU lacks) kills it."""
    try:
        out = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{binary} failed to run: {exc}") from exc
    if out.returncode < 0:
        raise BuildError(f"{binary} died with signal {-out.returncode} (SIGILL means it was built for instructions this CPU lacks)")


def build(p: Plan, *, jobs: int = DEFAULT_JOBS, force: bool = False, tools: tuple[str, ...] = TOOLS) -> Path:
    """Fetch, configure and build those of `tools` that `p` has not cached; return llama-server's path."""
    folder = p.folder
    with _locked(folder.with_name(folder.name + ".lock")):
        missing = [t for t in tools if force or not p.tool(t).is_file()]
        if not missing:
            return p.binary
        folder.mkdir(parents=True, exist_ok=True)
        src, out, log = folder / "src", folder / "build", folder / "build.log"
        if force:
            shutil.rmtree(out, ignore_errors=True)
            for t in missing:
                p.tool(t).unlink(missing_ok=True)
        if not (src / "CMakeLists.txt").is_file():
            shutil.rmtree(src, ignore_errors=True)
            _extract(_sdist(p.version), src)
        say(f"building {', '.join(missing)} from {PACKAGE} {p.version} for this CPU ({describe(p.options)}) with -j{jobs} into {folder}; several minutes on 2 cores")
        started = time.monotonic()
        if not (out / "CMakeCache.txt").is_file():
            configure = [p.cmake, "-S", str(src), "-B", str(out), "-G", p.generator, *[f"-D{k}={v}" for k, v in p.options.items()]]
            _run_logged(configure, log, "configure")
        _run_logged([p.cmake, "--build", str(out), "--target", *missing, "--parallel", str(jobs)], log, "build")
        version = ""
        for t in missing:
            built = out / "bin" / t
            if not built.is_file():
                raise BuildError(f"the build finished but {built} is missing; log {log}")
            if t == "llama-server":
                version = probe(built)
            else:
                probe_tool(built)
            tmp = p.tool(t).with_name(t + ".tmp")
            shutil.copy2(built, tmp)
            tmp.rename(p.tool(t))  # a cached binary appears only once it built and ran
        manifest_path = folder / "build.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        version = version or manifest.get("version", "")
        manifest.update({"package": f"{PACKAGE}=={p.version}", "version": version, "tools": [t for t in TOOLS if p.tool(t).is_file()], "cpu": describe(p.options), "cmake_options": p.options,
            "generator": p.generator, "compilers": list(p.compilers), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "build_s": round(time.monotonic() - started)})
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        if all(p.tool(t).is_file() for t in TOOLS):
            shutil.rmtree(src, ignore_errors=True)  # ~260 MB kept only while a build may resume
            shutil.rmtree(out, ignore_errors=True)
        say(f"built {', '.join(missing)} in {time.monotonic() - started:.0f} s into {folder}")
        return p.binary


@dataclass(frozen=True)
class Binary:
    """A llama-server that ran `--version` here, and where it came from."""

    path: Path
    version: str
    origin: str  # "on PATH" or "built from llama-cpp-python X for <flags>"


@dataclass(frozen=True)
class Tool:
    """Another llama.cpp program from the same sources as the server peer; `key` names its build."""

    path: Path
    key: str


@functools.cache
def tool_binary(name: str, version: str = DEFAULT_VERSION) -> Tool:
    """llama.cpp program `name` built with the llama-server peer: beside it where that came from
    PATH, else the cached build for this CPU (built now if missing). Raises BuildError."""
    server = server_binary() if version == DEFAULT_VERSION else server_binary(version)  # one lru_cache entry with the peer's call
    if server.origin == "on PATH":
        beside = server.path.with_name(name)
        if not beside.is_file():
            raise BuildError(f"llama-server is {server.path} (on PATH) but {beside} is missing: the files must come from the same llama.cpp")
        return Tool(beside, f"path-{hashlib.sha256(server.version.encode()).hexdigest()[:12]}")
    p = plan(version)
    if not p.tool(name).is_file():
        build(p, tools=(name,))
    return Tool(p.tool(name), p.key)


@functools.cache
def server_binary(version: str = DEFAULT_VERSION, cpu: str = "native") -> Binary:
    """`llama-server` from PATH if it runs here, else the cached build for this CPU (built now if
    missing); for a `cpu` level other than "native", always the cached build for that level.

    Raises BuildError when neither works; the bench then skips the peer with that reason.
    """
    on_path = shutil.which("llama-server") if cpu == "native" else None
    if on_path:
        try:
            return Binary(Path(on_path), probe(on_path), "on PATH")
        except BuildError as exc:
            say(f"ignoring {on_path}: {exc}")
    p = plan(version, cpu)
    path = build(p, tools=("llama-server",) if p.binary.is_file() else TOOLS)  # a fresh build makes both at once
    say(f"llama-server: {path}")
    return Binary(path, probe(path), f"built from {PACKAGE} {version} for {describe(p.options)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help=f"{PACKAGE} release whose vendored llama.cpp to build (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="parallel compile jobs (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the binary is cached")
    parser.add_argument("--show", action="store_true", help="print the plan (CMake options, cache folder) and exit without building")
    parser.add_argument("--cpu", choices=CPU_LEVELS, default="native", help="build for this CPU's extensions, or as for an AVX2-only CPU (default %(default)s)")
    opts = parser.parse_args(argv)
    try:
        p = plan(opts.version, opts.cpu)
        if opts.show:
            print(json.dumps({"folder": str(p.folder), "cached": p.binary.is_file(), "cpu": describe(p.options), "generator": p.generator, "cmake_options": p.options}, indent=2))
            return 0
        path = build(p, jobs=opts.jobs, force=opts.force)
        say(f"llama-server --version: {probe(path)}")
    except BuildError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
