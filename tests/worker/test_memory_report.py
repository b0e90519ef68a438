"""The worker says what its model's memory is: the weights (the mapped file's part among them), the
KV cache at the served context, and the rest (worker/memory_report.py)."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kiln.worker.loading.gguf_header import read_header
from kiln.worker.loading.loader import load_model
from kiln.worker.memory_report import log_memory, memory_report


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory, gguf_path):
    from .tiny_gguf import write_pair

    _, md = mx.load(str(gguf_path), return_metadata=True)
    path, _ = write_pair("llama", "Q8_0", md, tmp_path_factory.mktemp("memory"))
    return path


def _quantized_bytes(path) -> int:
    """Bytes of the file's quantized tensors, from its header."""
    total = 0
    for t in read_header(path).tensors:
        qtype = GGMLQuantizationType(t.type_id)
        if qtype.name not in ("F32", "F16"):
            block, size = GGML_QUANT_SIZES[qtype]
            total += int(np.prod(t.shape)) // block * size
    return total


def test_blocks_are_the_mapped_weights_and_the_kv_cache_follows_the_context(tiny_q8, caplog):
    from kiln.worker.loading.device import keeps_gguf_blocks

    loaded = load_model(str(tiny_q8))
    args = loaded.model.args
    report = memory_report(loaded.model, 512)
    head_dim = args.hidden_size // args.num_attention_heads
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * 4  # float32 keys and values
    assert report["kv_bytes_per_token"] == per_token
    assert report["kv_cache_bytes"] == per_token * 512 and report["context_window"] == 512
    if keeps_gguf_blocks("auto"):  # the CPU worker keeps Q8_0 as the file's blocks, or in panels of the same size
        from kiln.worker.loading.ggml_blocks import ggml_weights

        blocks = [w for _, m in loaded.model.named_modules() if (w := ggml_weights(m)) is not None]
        in_panels = sum(w.blocks.nbytes for w in blocks if w.repacked)
        assert report["weights_mapped_bytes"] == _quantized_bytes(tiny_q8) - in_panels
        assert 0 <= report["weights_bytes"] - _quantized_bytes(tiny_q8) < _quantized_bytes(tiny_q8) / 10  # norms only
    # the rest: the resident set less the weights' part of it (mapped ones: their pages in memory)
    assert max(0, report["rss_bytes"] - report["weights_bytes"]) <= report["other_bytes"] <= report["rss_bytes"]
    with caplog.at_level(logging.INFO, logger="kiln.worker.loading"):
        log_memory("tiny", report)
    assert "memory of tiny: weights" in caplog.text and "a sequence at 512 tokens" in caplog.text


def test_the_bundled_models_weights_are_its_files_size_or_float32(gguf_model):
    """On the CPU with the native kernels the bundled model's matrices are the file's blocks (in
    panels: the process's own memory, or mapped from where an earlier start kept them), so its
    weights are about the file's size; without the kernels, float32 copies and packed ones, nothing
    mapped, more than 4 bytes a weight against the file's ~0.6."""
    from kiln.worker.loading.device import keeps_gguf_blocks, on_cpu

    if not on_cpu():
        pytest.skip("the float32 copies and the blocks are the CPU's")
    report = memory_report(gguf_model.model, 8192)
    size = gguf_model.source_path.stat().st_size
    if keeps_gguf_blocks("auto"):
        assert 0.9 * size < report["weights_bytes"] < 1.2 * size
    else:
        assert report["weights_mapped_bytes"] == 0
        assert report["weights_bytes"] > 4 * size


def test_a_mapped_matrix_counts_as_far_as_its_pages_are_in(tmp_path):
    """A memory-mapped matrix takes the resident set a page at a time, as it is read: the memory
    report counts that part of it, not its size (a start that maps kept panels used to report
    "the rest 0 MB"), and a page two matrices share once."""
    from kiln.worker.memory import resident_part

    path = tmp_path / "weights.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    first, second = mapped[: 4 << 20], mapped[4 << 20 :]
    if resident_part([mapped]) is None:
        pytest.skip("no /proc/self/pagemap here")
    assert resident_part([mapped]) == 0
    int(first.sum())
    assert resident_part([first, second]) == 4 << 20
    assert resident_part([first, mapped, second]) == 4 << 20
    int(second.sum())
    assert resident_part([first, second]) == 8 << 20
    own = np.ones(1 << 20, dtype=np.uint8)
    assert (1 << 20) <= resident_part([own]) <= (1 << 20) + 4096
