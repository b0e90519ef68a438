"""The worker imports mlx-lm's submodules without its package __init__ (which imports
transformers, a second of every start), and mlx-lm's top-level API still works when asked for."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_submodules_import_without_transformers_and_the_package_api_appears_on_use() -> None:
    out = _run(
        """
        import importlib.metadata, sys
        from kiln.worker.loading.mlx_lm_import import defer_package_init
        assert defer_package_init() is True
        assert defer_package_init() is False  # already registered: nothing done twice
        import mlx_lm.models.cache, mlx_lm.models.llama, mlx_lm.sample_utils
        before = "transformers" in sys.modules
        import mlx_lm
        version = mlx_lm.__version__  # first use of what the __init__ defines: it runs now
        from mlx_lm import load, generate
        print(before, version == importlib.metadata.version("mlx-lm"), callable(load), callable(generate))
        """
    )
    assert out == "False True True True"


def test_an_unknown_attribute_is_still_an_attribute_error() -> None:
    out = _run(
        """
        from kiln.worker.loading.mlx_lm_import import defer_package_init
        defer_package_init()
        import mlx_lm
        print(hasattr(mlx_lm, "no_such_thing"), hasattr(mlx_lm, "load"))
        """
    )
    assert out == "False True"
