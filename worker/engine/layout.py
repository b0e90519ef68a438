"""Dense weights stored input-major, for fast decoding on mlx's CPU backend.

Why: nn.Linear computes x @ W.T with W stored (out, in). On the CPU mlx hands that to
cblas_sgemm with a transpose flag. Decoding is a skinny product (1..8 rows against every
weight, a memory-bound read), and which layout OpenBLAS streams faster depends on the
CPU: on an AVX2 EPYC W.T stored contiguously took 25-35 % less time per decode step of a
SmolLM2-sized llama; on an AVX-512 EPYC the stock layout was ~25 % faster. Metal and
CUDA kernels take either layout at full speed. So on the CPU the worker measures both at
start-up and keeps the faster (choose_weight_layout).

The swap is in place and value-preserving (same parameters, transposed once): the model
computes the same function. Quantized layers are left alone.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..loading.parameters import flat_parameters

log = logging.getLogger(__name__)


class InputMajorLinear(nn.Module):
    """nn.Linear with its weight stored transposed: (in, out)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        self.weight_t = mx.contiguous(linear.weight.T)
        if "bias" in linear:
            self.bias = linear.bias

    @property
    def weight(self) -> mx.array:
        """The usual (out, in) view, for code that inspects the layer."""
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


class InputMajorEmbedding(nn.Module):
    """nn.Embedding stored (dims, vocab), so a tied output head reads it fast."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        self.weight_t = mx.contiguous(embedding.weight.T)

    @property
    def weight(self) -> mx.array:
        """The usual (vocab, dims) view, for code that inspects the layer."""
        return self.weight_t.T

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.moveaxis(mx.take(self.weight_t, ids, axis=1), 0, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


def _floating(weight: mx.array) -> bool:
    return mx.issubdtype(weight.dtype, mx.floating)


def _swap_for(child: object, tied: bool) -> nn.Module | None:
    # Exactly these classes (not subclasses such as the packed or GGUF-block layers), and dense.
    if type(child) is nn.Linear and _floating(child.weight):
        return InputMajorLinear(child)
    if tied and type(child) is nn.Embedding and _floating(child.weight):
        return InputMajorEmbedding(child)
    return None


def _probe(model: nn.Module) -> mx.array:
    from mlx_lm.models.cache import make_prompt_cache

    logits: mx.array = model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model))
    mx.eval(logits)
    return logits


@dataclass
class _Swap:
    """One dense module and its input-major copy, and where the model holds it."""

    container: Any  # the parent module, or the list holding the layer
    key: Any  # attribute name or list index
    stock: nn.Module
    input_major: nn.Module


def _swaps(model: nn.Module) -> list[_Swap]:
    """An input-major copy of every dense Linear (and of an Embedding used as a tied head)."""
    tied = bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))
    out: list[_Swap] = []
    for _, parent in model.named_modules():
        for name, child in parent.children().items():
            items = enumerate(child) if isinstance(child, list) else [(name, child)]
            container = child if isinstance(child, list) else parent
            for key, item in items:
                copy = _swap_for(item, tied)
                if copy is not None:
                    out.append(_Swap(container, key, item, copy))
    return out


def _use(swaps: list[_Swap], input_major: bool) -> None:
    for swap in swaps:
        swap.container[swap.key] = swap.input_major if input_major else swap.stock


def _verified_swaps(model: nn.Module) -> list[_Swap]:
    """The swaps, applied, if the model computes the same with them; else none (undone).

    The model is run on a short probe before and after: a model that reads ``.weight``
    directly would disagree."""
    swaps = _swaps(model)
    if not swaps:  # e.g. every matrix GGUF blocks (loading/ggml_blocks.py): no probe pass either
        return []
    before = _probe(model)
    _use(swaps, True)
    mx.eval(model.parameters())
    try:
        ok = bool(mx.allclose(_probe(model), before, rtol=1e-3, atol=1e-3).item())
    except Exception:
        ok = False
    if not ok:
        _use(swaps, False)
        return []
    return swaps


@contextmanager
def input_major_while(model: nn.Module) -> Iterator[None]:
    """Dense weights stored input-major inside the block only (for measuring both layouts)."""
    swaps = _swaps(model)
    _use(swaps, True)
    mx.eval(model.parameters())
    try:
        yield
    finally:
        _use(swaps, False)


def use_input_major_weights(model: nn.Module) -> int:
    """Swap every dense Linear (and an Embedding used as a tied head) in place.

    Returns how many modules were swapped; 0 when the swapped model would compute something
    else (then nothing is changed).
    """
    return len(_verified_swaps(model))


def _decode_step_seconds(model: nn.Module, steps: int) -> float:
    """Median time of single-row decode steps after a 32-token prompt."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, 33))]), cache=cache))
    token = mx.array([[1]])
    times = []
    for _ in range(steps + 1):  # the first step warms up
        start = time.perf_counter()
        mx.eval(model(token, cache=cache))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def choose_weight_layout(model: nn.Module, *, steps: int = 3, rounds: int = 2, max_bytes: int = 4 << 30) -> bool:
    """Keep whichever layout decodes faster here; True when input-major won.

    Which layout OpenBLAS reads faster depends on the CPU (input-major won by 25-35 % on
    an AVX2 EPYC; the stock layout won by ~25 % on an AVX-512 one), so it is measured at
    start-up rather than assumed: a few single-row decode steps per layout, alternating
    so that drift in machine load hits both (about two seconds for a 135M model). Both
    copies exist while measuring, so models over ``max_bytes`` keep the stock layout.
    """
    if sum(v.nbytes for _, v in flat_parameters(model)) > max_bytes:
        return False
    swaps = _verified_swaps(model)  # applied: the model is input-major now
    if not swaps:
        return False
    stock: list[float] = []
    swapped: list[float] = []
    for _ in range(rounds):
        _use(swaps, True)
        swapped.append(_decode_step_seconds(model, steps))
        _use(swaps, False)
        stock.append(_decode_step_seconds(model, steps))
    ms_stock, ms_swapped = 1e3 * statistics.median(stock), 1e3 * statistics.median(swapped)
    faster = ms_swapped < ms_stock
    _use(swaps, faster)
    log.info("weight layout: %s (%.1f ms per decode step; stock %.1f, input-major %.1f)", "input-major" if faster else "stock", min(ms_stock, ms_swapped), ms_stock, ms_swapped)
    return faster


def on_cpu() -> bool:
    """Whether arrays are computed on the CPU by default."""
    return mx.default_device() == mx.cpu
