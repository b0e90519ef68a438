"""Fixtures for the worker's tests: the bundled GGUF and an mlx-lm folder made from it, and every
build of the native kernels this CPU runs.

Loading is the slow part of these tests, so the loaded models are shared per session.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from kiln.worker.native import build as native


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from kiln.worker.loading.loader import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def gguf_tokenizer(gguf_path):
    """The Tokenizer built from the GGUF's metadata alone (no weights kept)."""
    import mlx.core as mx

    from kiln.worker.loading.tokenizer import Tokenizer

    _, metadata = mx.load(str(gguf_path), return_metadata=True)
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="session")
def gguf_model():
    """The bundled model as load_model(None) gives it (dequantized to float32 on the CPU)."""
    from kiln.worker.loading.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def mlx_folder(tmp_path_factory, gguf_path) -> Path:
    """The bundled GGUF exported as an mlx-lm folder, keeping its quantized weights."""
    from kiln.worker.loading.export import export_folder

    return export_folder(gguf_path, tmp_path_factory.mktemp("smollm2-mlx"))


@pytest.fixture(scope="module", params=[v.name for v in native.variants()])
def kernel(request):
    """Every build of the kernels this CPU runs (the portable one included); test_native.py has its
    own (the one build this machine loads)."""
    compiler = native._compiler()
    if compiler is None:
        pytest.skip("no C compiler for the native CPU kernels")
    variant = next(v for v in native.variants() if v.name == request.param)
    _, flags = native._cpu_flags()
    if flags is not None and not variant.needs <= flags:
        pytest.skip(f"this CPU lacks {variant.name}")
    library = native._build(compiler, variant)
    if not native._runs_here(library):
        pytest.skip(f"{variant.name} does not run here")
    return native.CpuKernels(ctypes.CDLL(str(library)), variant.name)
