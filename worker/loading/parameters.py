"""A model's parameters as (dotted name, array) pairs.

``mlx.utils.tree_flatten`` declares a list *or* a dict (the dict only when given a
``destination``), so every caller would narrow it again; this names what it returns here.
mlx is imported inside, so importing this module stays free (see mlx_lm_import.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn


def flat_parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    """``tree_flatten(model.parameters())``: every parameter with its dotted name."""
    from mlx.utils import tree_flatten

    return cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
