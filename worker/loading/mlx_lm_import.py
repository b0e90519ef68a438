"""Import mlx-lm's submodules without first running its package ``__init__``.

Why: ``mlx_lm/__init__.py`` imports ``convert``, ``generate`` and ``utils`` to offer its
top-level ``load``/``generate``, and they import ``transformers`` and ``huggingface_hub``:
about 1.0-1.5 s of every worker start on the 2-core test machine (``python -X importtime``:
transformers 1.0 s of the 1.5 s that ``import mlx_lm.models.cache`` takes), for code a GGUF
model never runs. The worker itself only imports submodules (``mlx_lm.models.*``,
``mlx_lm.sample_utils``, ``mlx_lm.tool_parsers.*``; the folder loader ``mlx_lm.utils``, which
imports transformers itself). ``defer_package_init`` registers the package with its search
path, so those imports work unchanged, and runs its ``__init__`` the first time an attribute
that only the ``__init__`` defines is asked for (``mlx_lm.load``, ``mlx_lm.__version__``):
code that needs them gets exactly what a plain ``import mlx_lm`` gives, just later.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

PACKAGE = "mlx_lm"


def defer_package_init(name: str = PACKAGE) -> bool:
    """Register package `name` in ``sys.modules`` with its ``__init__`` not yet run; False (and
    nothing done) where it is already imported or not installed. Call before anything imports it."""
    if name in sys.modules:
        return False
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return False
    loader = spec.loader
    module = importlib.util.module_from_spec(spec)

    def __getattr__(attr: str) -> Any:
        # Only reached for what the module does not have yet: run its __init__ now, once.
        del module.__dict__["__getattr__"]
        loader.exec_module(module)
        try:
            return module.__dict__[attr]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None

    module.__dict__["__getattr__"] = __getattr__
    if name == PACKAGE:
        # What mlx-lm's __init__ sets before its first transformers import; kept for the
        # submodules (mlx_lm.utils) that import transformers before the __init__ has run.
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    sys.modules[name] = module
    return True
