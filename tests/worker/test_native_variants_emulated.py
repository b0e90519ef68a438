"""Every build of the native kernels, including those this machine's CPU cannot run: checked
under emulation against plain-C references (tests/worker/native_driver.c).

Why: test_native.py loads the one build this CPU takes (and the portable one) into Python, so
the Arm dotprod loops were never compiled on the development machines and the AVX-VNNI loops
never run. Here each variant is compiled with the worker's own flags (native.COMPILE_FLAGS and
the variant's) into the driver program, which checks every product kind and a whole forward
pass in both activation modes. A build for another architecture is cross-compiled and run
under qemu-user (``-cpu max``); one for this architecture runs natively where this CPU has its
instructions, else under qemu where its TCG has them. qemu 7.2 (Debian 12) executes Armv8.2
dotprod, AVX2, FMA and F16C, but neither AVX-512 nor AVX-VNNI: the avxvnni build then runs
natively on an AVX-512 VNNI CPU with its one VNNI instruction (``{vex} vpdpbusd``) reassembled
as the EVEX encoding of the same instruction: all that this leaves unchecked is that one
encoding and the build's CPUID gate.

Without the cross compiler or qemu (``./dev setup`` installs them on Debian/Ubuntu as root:
packages gcc-aarch64-linux-gnu and qemu-user) these tests skip and say which is missing.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.worker.native import build as native

DRIVER = Path(__file__).with_name("native_driver.c")
SKIPPED = 77  # the driver's exit status where the CPU lacks the build's instructions
HOST = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
# Debian's package for each architecture's cross compiler (for the skip message).
CROSS_PACKAGE = {"aarch64": "gcc-aarch64-linux-gnu", "x86_64": "gcc-x86-64-linux-gnu"}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the driver is built and emulated as a Linux program")


@dataclass(frozen=True)
class Build:
    """One variant of one architecture, as the worker on that architecture would compile it."""

    arch: str
    variant: native.Variant

    @property
    def name(self) -> str:
        return f"{self.arch}-{self.variant.name}"

    def compiler(self) -> str | None:
        """This machine's compiler for the build's architecture: its own, or the cross compiler."""
        return native._compiler() if self.arch == HOST else shutil.which(f"{self.arch}-linux-gnu-gcc")

    def flags(self) -> list[str]:
        return [*native.COMPILE_FLAGS, *self.variant.flags, f"-I{Path(native.__file__).parent}"]


def runnable_here(build: Build) -> bool:
    """Whether this CPU runs the build natively (then test_native.py loads it into Python too)."""
    _, flags = native._cpu_flags()
    return build.arch == HOST and (flags is None or build.variant.needs <= flags)


def builds() -> list[Build]:
    return [Build(arch, v) for arch in ("aarch64", "x86_64") for v in native.variants(arch)]


class Programs:
    """The driver built once per variant for the module: compiled to assembly (which the
    avxvnni re-encoding edits), then assembled and linked."""

    def __init__(self, out: Path) -> None:
        self._out = out
        self._built: dict[str, Path] = {}

    def assembly(self, build: Build) -> Path:
        target = self._out / f"driver-{build.name}.s"
        if not target.exists():
            cc = build.compiler()
            if cc is None:
                pytest.skip(f"no {build.arch} C compiler (install {CROSS_PACKAGE.get(build.arch, 'a cross compiler')})")
            done = subprocess.run([cc, *build.flags(), str(DRIVER), "-S", "-o", str(target)], capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{build.name} does not compile:\n{done.stderr[-3000:]}"
        return target

    def program(self, build: Build, assembly: Path | None = None) -> Path:
        """The linked driver, from the build's own assembly or from an edited copy of it."""
        source = assembly or self.assembly(build)
        if source.name not in self._built:
            program = source.with_suffix("")
            done = subprocess.run([str(build.compiler()), "-fopenmp", str(source), "-o", str(program), "-lm"], capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{source.name} does not link:\n{done.stderr[-3000:]}"
            self._built[source.name] = program
        return self._built[source.name]


def runner(build: Build, cpu: str = "max") -> list[str]:
    """How to run the build's program here: directly where this CPU has its instructions, else
    under qemu-user's emulation of `cpu` (skips without qemu for its architecture)."""
    if cpu == "max" and runnable_here(build):
        return []
    qemu = shutil.which(f"qemu-{build.arch}")
    if qemu is None or build.compiler() is None:
        missing = [f"qemu-{build.arch} (package qemu-user)"] if qemu is None else []
        if build.compiler() is None:
            missing.append(f"{build.arch}-linux-gnu-gcc (package {CROSS_PACKAGE.get(build.arch, 'its cross compiler')})")
        pytest.skip(f"this CPU cannot run the {build.name} build; emulating it needs {' and '.join(missing)} (./dev setup installs them where it can)")
    sysroot = [] if build.arch == HOST else ["-L", f"/usr/{build.arch}-linux-gnu"]
    return [qemu, "-cpu", cpu, *sysroot]


def run(command: list[str]) -> subprocess.CompletedProcess[str]:
    # Two threads even on one core: the forward pass's OpenMP team and barriers run as they do in the worker.
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def passed(done: subprocess.CompletedProcess[str], what: str) -> None:
    assert done.returncode == 0 and "\n0 failed" in done.stdout, f"{what} (exit {done.returncode}):\n{done.stdout[-6000:]}{done.stderr[-2000:]}"


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> Programs:
    return Programs(tmp_path_factory.mktemp("native-variants"))


# The builds this CPU runs itself are what test_native.py checks through Python: here they
# only check the driver (slow suite); the others are what nothing else checks.
@pytest.mark.parametrize(
    "build", [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if runnable_here(b) else []) for b in builds()]
)
def test_build_matches_the_plain_c_reference(build: Build, programs: Programs):
    """Each variant, built with the worker's flags for it, selects its own code path (the
    driver checks kiln_variant()) and passes its self-test, every product kind and a whole
    forward pass against the plain-C reference: where this CPU runs it, natively, else under
    qemu; where neither does (qemu 7.2 has no AVX-512 or AVX-VNNI) it skips and says so."""
    emulator = runner(build)
    done = run([*emulator, str(programs.program(build)), build.variant.name])
    where = f"{Path(emulator[0]).name} -cpu max" if emulator else "this CPU"
    if done.returncode == SKIPPED:
        pytest.skip(f"{where} does not execute the {build.name} build's instructions: {done.stdout.strip().removeprefix('skip ')}")
    passed(done, f"{build.name} on {where}")


def test_dotprod_build_is_refused_by_an_armv8_0_cpu(programs: Programs):
    """On an Arm CPU without dotprod (qemu's Cortex-A53) the dotprod build's self-test says so
    (HWCAP) instead of dying of SIGILL, so the worker passes it over for the portable build."""
    dotprod = next(b for b in builds() if b.variant.name == "dotprod")
    done = run([*runner(dotprod, cpu="cortex-a53"), str(programs.program(dotprod)), "dotprod"])
    assert done.returncode == SKIPPED, done.stdout + done.stderr


def test_avxvnni_build_with_its_vnni_instruction_reencoded(programs: Programs):
    """The avxvnni build, compiled with its flags to assembly, its VEX vpdpbusd (AVX-VNNI)
    reassembled as the EVEX vpdpbusd (AVX-512 VNNI: the same operation on the same ymm
    registers), run natively on an AVX-512 VNNI CPU. Everything else of the build is what an
    AVX-VNNI CPU runs; its CPUID check (which this CPU fails) is the driver's to skip."""
    _, flags = native._cpu_flags()
    if HOST != "x86_64" or flags is None or not {"avx512_vnni", "avx512vl", "avx2", "fma", "f16c"} <= flags:
        pytest.skip("needs an x86-64 CPU with AVX-512 VNNI")
    build = Build("x86_64", next(v for v in native.variants("x86_64") if v.name == "avxvnni"))
    text, swapped = re.subn(r"\{vex\}\s*vpdpbusd", "{evex} vpdpbusd", programs.assembly(build).read_text())
    assert swapped > 0, "the avxvnni build has no AVX-VNNI dot product to check"
    assert "{vex}" not in text, "the avxvnni build has other VEX-only instructions; this check no longer covers it"
    edited = programs.assembly(build).with_name("driver-x86_64-avxvnni-evex.s")
    edited.write_text(text)
    done = run([str(programs.program(build, edited)), "avxvnni", "--cpuid-unchecked"])
    passed(done, f"avxvnni with {swapped} vpdpbusd re-encoded")
