"""The native pass's build check runs once per model file, kernel build and code: a worker that
starts again on the same file takes the verdict from the cache (native_verdict.py)."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from kiln.worker.engine.native_decode import NativeDecoder
from kiln.worker.engine.native_verdict import RECHECK_ENV, CheckSource, VerdictStore, build_checked
from kiln.worker.native.build import cpu_kernels


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory, gguf_path):
    if cpu_kernels() is None:
        pytest.skip("no C compiler for the native CPU kernels")
    from .tiny_gguf import write_pair

    _, md = mx.load(str(gguf_path), return_metadata=True)
    path, _ = write_pair("llama", "Q4_0", md, tmp_path_factory.mktemp("verdict"))
    return path


@pytest.fixture
def checks(monkeypatch):
    """Counts the build checks that really run (mlx against the native pass)."""
    ran: list[bool] = []
    real = NativeDecoder._matches

    def counted(self, model):
        ran.append(self.int8)
        return real(self, model)

    monkeypatch.setattr(NativeDecoder, "_matches", counted)
    monkeypatch.delenv(RECHECK_ENV, raising=False)
    return ran


def _start(path):
    """What a worker start does: load the model, build the native pass."""
    from kiln.worker.loading.loader import load_model

    return load_model(str(path)).model


def test_second_start_takes_the_verdict_from_the_cache(tiny_file, checks, tmp_path):
    store = VerdictStore(tmp_path)
    first = build_checked(_start(tiny_file), CheckSource(tiny_file), store)
    assert first is not None and len(checks) == 1
    second = build_checked(_start(tiny_file), CheckSource(tiny_file), store)
    assert second is not None and second.int8 == first.int8
    assert len(checks) == 1  # not checked again


def test_a_changed_file_or_a_recheck_is_checked_again(tiny_file, checks, tmp_path, monkeypatch):
    store = VerdictStore(tmp_path)
    build_checked(_start(tiny_file), CheckSource(tiny_file), store)
    st = os.stat(tiny_file)
    os.utime(tiny_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    build_checked(_start(tiny_file), CheckSource(tiny_file), store)
    assert len(checks) == 2
    build_checked(_start(tiny_file), CheckSource(tiny_file, weight_layout="stock"), store)
    assert len(checks) == 3  # another setting that shapes the weights
    monkeypatch.setenv(RECHECK_ENV, "1")
    build_checked(_start(tiny_file), CheckSource(tiny_file), store)
    assert len(checks) == 4


def test_a_remembered_failure_decodes_through_mlx_without_checking(tiny_file, checks, tmp_path):
    store = VerdictStore(tmp_path)
    source = CheckSource(tiny_file)
    library = os.path.basename(cpu_kernels().library._name)
    store.put(source.key(library), {"int8": False, "float32": False}, tiny_file)
    assert build_checked(_start(tiny_file), source, store) is None
    assert checks == []


def test_unwritable_cache_still_builds(tiny_file, checks, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    decoder = build_checked(_start(tiny_file), CheckSource(tiny_file), VerdictStore(blocker / "verdicts"))
    assert decoder is not None and len(checks) == 1


def test_the_8_bit_cache_check_is_kept_beside_the_first(gguf_path, checks, tmp_path):
    """--kv-cache int8 checks the pass twice (against mlx, then with the 8-bit cache against
    that): a later start takes both verdicts and keeps the 8-bit cache without a check."""
    from .test_native_ggml import _SHAPE
    from .tiny_gguf import CONFIGS, write_pair

    kernels = cpu_kernels()
    if kernels is None or not (kernels.gemm or kernels.panels):
        pytest.skip("this build has neither the prefill GEMM nor panel loops: the 8-bit cache is not kept")
    _, md = mx.load(str(gguf_path), return_metadata=True)
    path, _ = write_pair("llama", "Q4_0", md, tmp_path, config=dict(CONFIGS["llama"], **_SHAPE))  # heads of 64: blocks of 32
    store = VerdictStore(tmp_path / "verdicts")
    first = build_checked(_start(path), CheckSource(path), store, kv="int8")
    assert first is not None and first.kv_int8 and len(checks) == 2
    second = build_checked(_start(path), CheckSource(path), store, kv="int8")
    assert second is not None and second.kv_int8 and len(checks) == 2
    plain = build_checked(_start(path), CheckSource(path), store)  # the first verdict serves it too
    assert plain is not None and not plain.kv_int8 and len(checks) == 2
