"""Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and IQ4_XS matrices read once into panels of 16 rows (worker/native/panels.c) are the same
matrices: every reader gets each row back bit for bit, the decode loops' products equal those of
the file's rows up to the order of float32 sums, the GEMM's are identical, and a loaded file
keeps the panels and lets its own pages go."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from kiln.worker.loading.ggml_blocks import PANELS_ENV, read_matrices
from kiln.worker.loading.gguf_read import release_pages

from .test_native_ggml import _block_bound, blocks, rounded

PANEL_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS)  # every type the loops take
SCALES = ["random", "max", "min", "zero", "zeros", "ones"]


def panels(kernel, b: np.ndarray, qtype: Q, k: int) -> tuple[np.ndarray, int]:
    packed = kernel.ggml_panels(b, int(qtype), k)
    if not kernel.panels:
        assert packed is None  # builds without the loops never repack
        pytest.skip(f"the {kernel.variant} build has no panel loops")
    assert packed is not None
    return packed


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scales", SCALES)
def test_panels_give_back_every_row_bit_for_bit(kernel, qtype, scales):
    rng = np.random.default_rng(11)
    b = blocks(rng, qtype, 48, 512, scales)
    p, ptype = panels(kernel, b, qtype, 512)
    assert p.nbytes == b.nbytes  # a panel is its 16 rows' bytes, laid another way: memory is the file's size
    np.testing.assert_array_equal(kernel.ggml_dequantize(p, ptype, 512), kernel.ggml_dequantize(b, int(qtype), 512))
    picked = np.array([47, 0, 17, 16, 15])
    np.testing.assert_array_equal(kernel.ggml_dequantize(p, ptype, 512, picked), kernel.ggml_dequantize(b, int(qtype), 512, picked))


def test_a_matrix_in_populated_pages_reads_back_the_same(kernel):
    """A matrix of more than 4 MB is read into memory mapped and faulted in by one call
    (build._populated): its rows and products are those of the file's rows all the same."""
    rng = np.random.default_rng(3)
    b = blocks(rng, Q.Q8_0, 256, 16384, "random")
    p, ptype = panels(kernel, b, Q.Q8_0, 16384)
    assert p.nbytes > 4 << 20
    picked = np.array([255, 0, 17, 128])
    np.testing.assert_array_equal(kernel.ggml_dequantize(p, ptype, 16384, picked), kernel.ggml_dequantize(b, int(Q.Q8_0), 16384, picked))
    x = rng.standard_normal((1, 16384)).astype(np.float32)
    np.testing.assert_array_equal(kernel.ggml_matmul(x, p, ptype, 16384, exact=True), kernel.ggml_matmul(x, b, int(Q.Q8_0), 16384, exact=True))


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_products_of_panels_are_those_of_the_rows(kernel, qtype, scales, rows, k=768):
    """The decode loops (rows <= 8 a tile, more in several) within the reference product's bound;
    the exact float32 product mlx's reference pass takes, identical."""
    rng = np.random.default_rng(5 + rows)
    b = blocks(rng, qtype, 32, k, scales)
    p, ptype = panels(kernel, b, qtype, k)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0.0
    x[-1, 32:64] *= 1e4
    w = kernel.ggml_dequantize(b, int(qtype), k).astype(np.float64)
    y = kernel.ggml_matmul(x, p, ptype, k).astype(np.float64)
    xr, _ = rounded(x)
    slack = 1e-5 * (np.abs(xr) @ _block_bound(b, qtype, k).T) + 1e-30
    assert np.all(np.abs(y - xr @ w.T) <= slack)
    np.testing.assert_array_equal(kernel.ggml_matmul(x, p, ptype, k, exact=True), kernel.ggml_matmul(x, b, int(qtype), k, exact=True))


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [16, 45])
def test_prefill_gemm_of_panels_is_that_of_the_rows(kernel, qtype, rows):
    """A panel is the GEMM's column tile as it stands: the same tile, the same sums. A build
    without the GEMM (AVX-VNNI's) takes a chunk's products through the panel loops, whose sums
    the test above bounds."""
    rng = np.random.default_rng(9 + rows)
    b = blocks(rng, qtype, 48, 512)
    p, ptype = panels(kernel, b, qtype, 512)
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    if not kernel.gemm:
        np.testing.assert_array_equal(kernel.ggml_gemm(x, p, ptype, 512), kernel.ggml_matmul(x, p, ptype, 512))
        return
    np.testing.assert_array_equal(kernel.ggml_gemm(x, p, ptype, 512), kernel.ggml_gemm(x, b, int(qtype), 512))


def test_which_matrices_take_panels(kernel, monkeypatch):
    """Every type the loops take, with rows a multiple of 16, where the build has the loops; not 24
    rows, not with KILN_NATIVE_PANELS=0."""
    rng = np.random.default_rng(0)
    kinds = [(qtype.name, rows) for qtype in PANEL_TYPES for rows in (32, 24)]
    matrices = [(blocks(rng, Q[name], rows, 256), name, 256) for name, rows in kinds]
    read = read_matrices(matrices, kernel)  # one native call for all of them
    made = {kind: weights.repacked for kind, weights in zip(kinds, read, strict=True)}
    assert made == {(name, rows): kernel.panels and rows == 32 for name, rows in made}
    for (b, name, _), weights in zip(matrices, read, strict=True):  # each its own matrix, bit for bit
        np.testing.assert_array_equal(weights.dequantize(), kernel.ggml_dequantize(b, int(Q[name]), 256))
    monkeypatch.setenv(PANELS_ENV, "0")
    assert not read_matrices([(blocks(rng, Q.Q4_K, 32, 256), "Q4_K", 256)], kernel)[0].repacked


def _rss_file_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


def test_released_pages_of_a_mapped_file_leave_memory_and_read_back(tmp_path):
    """The loader lets go of a repacked matrix's pages in the mapped file: they leave the
    process's resident memory, and what reads them later still reads the file."""
    data = np.random.default_rng(1).integers(0, 256, size=(64 << 20) // 4096 * 4096, dtype=np.uint8)
    path = tmp_path / "blocks.bin"
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    view = mapped[4096:].reshape(-1, 4096)
    assert int(view.sum(dtype=np.int64)) == int(data[4096:].sum(dtype=np.int64))  # every page resident
    before = _rss_file_kb()
    release_pages(view)
    assert before - _rss_file_kb() >= 48 << 10  # most of the 64 MB
    np.testing.assert_array_equal(view[-1], data[-4096:])


def test_releasing_pages_leaves_arrays_in_memory_alone():
    array = np.arange(1 << 20, dtype=np.uint8).reshape(-1, 4096)
    kept = array.copy()
    release_pages(array)
    release_pages(array[16:])
    np.testing.assert_array_equal(array, kept)

