"""bench/llama_cpp.py builds llama-quantize beside llama-server, from the same sources and
options, and rebuilds nothing it has cached (no compiler runs here: the build steps are recorded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import llama_cpp


@pytest.fixture
def plan(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return llama_cpp.Plan("0.0.0", {"GGML_NATIVE": "OFF"}, "cmake", "Ninja", ("cc 1", "c++ 1"))


@pytest.fixture
def steps(monkeypatch, plan):
    """Every command the build would run; a `--build` step leaves its targets in build/bin."""
    ran: list[list[str]] = []

    def run(argv, log, what, report=None):
        ran.append(argv)
        out = plan.folder / "build"
        if "--build" in argv:
            targets = argv[argv.index("--target") + 1 : argv.index("--parallel")]
            (out / "bin").mkdir(parents=True, exist_ok=True)
            for t in targets:
                (out / "bin" / t).write_text(t)
        else:
            out.mkdir(parents=True, exist_ok=True)
            (out / "CMakeCache.txt").write_text("")

    def extract(archive, dest: Path):
        dest.mkdir(parents=True)
        (dest / "CMakeLists.txt").write_text("")

    monkeypatch.setattr(llama_cpp, "_run_logged", run)
    monkeypatch.setattr(llama_cpp, "_extract", extract)
    monkeypatch.setattr(llama_cpp, "_sdist", lambda version: Path("sdist.tar.gz"))
    monkeypatch.setattr(llama_cpp, "probe", lambda binary: "0.0.0-test")
    monkeypatch.setattr(llama_cpp, "probe_tool", lambda binary: None)
    return ran


def test_a_fresh_build_makes_both_tools_in_one_build_and_cleans_up(plan, steps):
    assert llama_cpp.build(plan) == plan.binary
    assert [s for s in steps if "--build" in s][0][4:6] == ["llama-server", "llama-quantize"]
    assert plan.tool("llama-quantize").read_text() == "llama-quantize"
    assert not (plan.folder / "src").exists() and not (plan.folder / "build").exists()


def test_a_server_only_folder_builds_just_the_quantizer_in_the_kept_build(plan, steps):
    plan.folder.mkdir(parents=True)
    plan.binary.write_text("old server")
    (plan.folder / "src").mkdir()
    (plan.folder / "src" / "CMakeLists.txt").write_text("")
    (plan.folder / "build").mkdir()
    (plan.folder / "build" / "CMakeCache.txt").write_text("")
    llama_cpp.build(plan, tools=("llama-quantize",))
    assert len(steps) == 1 and "configure" not in steps[0] and steps[0][4:5] == ["llama-quantize"]
    assert plan.binary.read_text() == "old server"  # untouched
    assert plan.tool("llama-quantize").is_file()


def test_cached_tools_are_not_rebuilt(plan, steps):
    plan.folder.mkdir(parents=True)
    for tool in llama_cpp.TOOLS:
        plan.tool(tool).write_text(tool)
    llama_cpp.build(plan)
    assert steps == []


def test_an_avx2_build_leaves_out_vnni_and_avx_512():
    """`--cpu avx2` on a Sapphire Rapids: llama-server built as for an AVX2-only CPU (what bench/
    compares Kiln's avx2 kernels with), AMX off as always; "native" keeps what the CPU lists."""
    flags = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512_vnni", "amx_int8"}
    avx2 = llama_cpp.cpu_options(llama_cpp.level_flags(flags, "avx2"), "x86_64")
    assert llama_cpp.describe(avx2) == "SSE42 AVX AVX2 FMA F16C BMI2"
    assert avx2["GGML_AVX512_VNNI"] == avx2["GGML_AMX_INT8"] == "OFF"
    native = llama_cpp.cpu_options(llama_cpp.level_flags(flags, "native"), "x86_64")
    assert native["GGML_AVX_VNNI"] == native["GGML_AVX512_VNNI"] == "ON" and native["GGML_AMX_INT8"] == "OFF"
    with pytest.raises(ValueError):
        llama_cpp.level_flags(flags, "avx10")
