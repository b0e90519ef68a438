"""A GGUF's panels kept on disk (worker/loading/panel_cache.py): the first start reads them and
keeps them, a later start maps them and packs nothing, and a kept file that is stale, cut short
or does not match the model's rows is never used."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from kiln.worker.loading import panel_cache
from kiln.worker.loading.ggml_blocks import read_matrices
from kiln.worker.loading.panel_cache import PanelCache
from kiln.worker.native.build import CpuKernels

from .test_native_ggml import blocks, tokenizer_md  # noqa: F401  # tokenizer_md: a fixture

KINDS = [("Q4_K", 48, 512), ("Q6_K", 32, 256), ("IQ4_XS", 32, 256), ("Q8_0", 16, 1024), ("Q4_0", 24, 256)]


@pytest.fixture
def matrices():
    rng = np.random.default_rng(4)
    return [(blocks(rng, Q[name], rows, k), name, k) for name, rows, k in KINDS]


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in")
    return path


def _no_packing(monkeypatch):
    def refuse(self, wanted):
        raise AssertionError("packed again: the kept panels were not used")

    monkeypatch.setattr(CpuKernels, "ggml_panels_many", refuse)


def _same_rows(read, matrices, kernel):
    for weights, (b, name, k) in zip(read, matrices, strict=True):
        np.testing.assert_array_equal(weights.dequantize(), kernel.ggml_dequantize(b, int(Q[name]), k))


def test_a_later_start_maps_the_kept_panels_and_packs_nothing(kernel, matrices, model_file, tmp_path, monkeypatch):
    if not kernel.panels:
        pytest.skip(f"the {kernel.variant} build has no panel loops")
    first = read_matrices(matrices, kernel, PanelCache.for_file(model_file, kernel, tmp_path / "kept"))
    assert [w.repacked for w in first] == [True, True, True, True, False]  # 24 rows have no panels
    assert [w.mapped for w in first] == [False, False, False, False, True]  # panels: the process's own memory
    _no_packing(monkeypatch)
    later = read_matrices(matrices, kernel, PanelCache.for_file(model_file, kernel, tmp_path / "kept"))
    assert [w.repacked for w in later] == [True, True, True, True, False]
    assert all(w.mapped for w in later)
    assert all(isinstance(w.blocks, np.memmap) for w in later if w.repacked)
    _same_rows(later, matrices, kernel)
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    np.testing.assert_array_equal(later[0].apply(x), first[0].apply(x))


def test_a_changed_model_file_is_read_again(kernel, matrices, model_file, tmp_path):
    before = PanelCache.for_file(model_file, kernel, tmp_path)
    assert before is not None
    read_matrices(matrices, kernel, before)
    os.utime(model_file, ns=(1, 1))
    after = PanelCache.for_file(model_file, kernel, tmp_path)
    assert after is not None and after.key != before.key
    assert after.mapped([(b, int(Q[name]), k) for b, name, k in matrices], kernel) is None


@pytest.mark.parametrize("damage", ["rows", "cut short"])
def test_a_kept_file_that_does_not_match_is_not_used(kernel, matrices, model_file, tmp_path, damage):
    """A flipped byte in a checked row, or a file shorter than its index says: the panels are
    read from the model's own blocks again (and kept again), every row as the file's."""
    if not kernel.panels:
        pytest.skip(f"the {kernel.variant} build has no panel loops")
    kept = PanelCache.for_file(model_file, kernel, tmp_path)
    assert kept is not None
    read_matrices(matrices, kernel, kept)
    with open(kept.data_path, "r+b") as fh:
        if damage == "rows":
            byte = fh.read(1)  # the low byte of the first row's scale in the first matrix's first unit
            fh.seek(0)
            fh.write(bytes([byte[0] ^ 0xFF]))
        else:
            fh.truncate(4096)
    assert kept.mapped([(b, int(Q[name]), k) for b, name, k in matrices], kernel) is None
    again = read_matrices(matrices, kernel, kept)
    assert not any(w.mapped for w in again if w.repacked)
    _same_rows(again, matrices, kernel)


def test_only_the_most_recent_files_are_kept(kernel, matrices, tmp_path):
    if not kernel.panels:
        pytest.skip(f"the {kernel.variant} build has no panel loops")
    caches = []
    for i in range(panel_cache.KEPT_FILES + 2):
        path = tmp_path / f"model-{i}.gguf"
        path.write_bytes(bytes([i]))
        caches.append(PanelCache.for_file(path, kernel, tmp_path / "kept"))
        read_matrices(matrices[:1], kernel, caches[-1])
        os.utime(caches[-1].data_path, (i, i))  # written in this order
    left = sorted(p.stem for p in (tmp_path / "kept").glob("*.panels"))
    assert left == sorted(c.key for c in caches[-panel_cache.KEPT_FILES :])
    assert sorted(p.stem for p in (tmp_path / "kept").glob("*.json")) == left


def test_turned_off_or_unwritable_it_only_reads(kernel, matrices, model_file, tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_bytes(b"")
    read = read_matrices(matrices, kernel, PanelCache.for_file(model_file, kernel, blocked / "kept"))
    _same_rows(read, matrices, kernel)
    monkeypatch.setenv(panel_cache.CACHE_ENV, "0")
    assert PanelCache.for_file(model_file, kernel, tmp_path) is None


def test_a_q4_k_m_file_starts_again_from_its_kept_panels(tmp_path, tokenizer_md, monkeypatch):  # noqa: F811
    """End to end: a Q4_K_M-style file loaded twice; the second load maps every matrix's panels
    from the kept file, packs nothing, and computes the same logits."""
    from kiln.worker.loading.device import keeps_gguf_blocks
    from kiln.worker.loading.ggml_blocks import ggml_weights

    if not keeps_gguf_blocks("auto"):
        pytest.skip("the worker keeps GGUF blocks only on the CPU with the native kernels")
    from kiln.worker.loading.loader import load_model

    from .test_native_ggml import _SHAPE
    from .tiny_gguf import CONFIGS, write_pair

    monkeypatch.setenv(panel_cache.CACHE_ENV, str(tmp_path / "panels"))
    gguf_file, _ = write_pair("llama", "K", tokenizer_md, tmp_path, config=dict(CONFIGS["llama"], **_SHAPE), k_types=(Q.Q4_K, Q.Q6_K), k_scale=2.0**-12)
    first = load_model(str(gguf_file)).model
    matrices = [w for _, m in first.named_modules() if (w := ggml_weights(m)) is not None]
    if not matrices[0].kernel.panels:
        pytest.skip("this build has no panel loops")
    assert [p.suffix for p in (tmp_path / "panels").iterdir()] != []
    _no_packing(monkeypatch)
    later = load_model(str(gguf_file)).model
    again = [w for _, m in later.named_modules() if (w := ggml_weights(m)) is not None]
    assert len(again) == len(matrices) and all(w.repacked and w.mapped for w in again)
    tokens = mx.array([[1, 5, 9, 14]])
    np.testing.assert_array_equal(np.array(later(tokens)), np.array(first(tokens)))
