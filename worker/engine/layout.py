"""Dense weights stored input-major, for fast decoding on mlx's CPU backend.

Why: nn.Linear computes x @ W.T with W stored (out, in). On the CPU mlx hands that to
cblas_sgemm with a transpose flag, and for the skinny products of decoding (1..8 rows
against the whole weight matrix, a memory-bound read of every weight) OpenBLAS is
markedly slower on that layout than on W.T stored contiguously (measured ~25-35% less
CPU time per decode step at batch 1 and 8 for a SmolLM2-sized llama). Metal and CUDA
kernels take either layout at full speed, so this is applied on the CPU only.

The swap is in place and value-preserving (same parameters, transposed once): the model
computes the same function. Quantized layers are left alone.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class InputMajorLinear(nn.Module):
    """nn.Linear with its weight stored transposed: (in, out)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
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
        super().__init__()
        self.weight_t = mx.contiguous(embedding.weight.T)

    @property
    def weight(self) -> mx.array:
        """The usual (vocab, dims) view, for code that inspects the layer."""
        return self.weight_t.T

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.moveaxis(mx.take(self.weight_t, ids, axis=1), 0, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


def _dense(m: object, kind: type) -> bool:
    return type(m) is kind and mx.issubdtype(m.weight.dtype, mx.floating)


def _swap_for(child: object, tied: bool) -> nn.Module | None:
    if _dense(child, nn.Linear):
        return InputMajorLinear(child)
    if tied and _dense(child, nn.Embedding):
        return InputMajorEmbedding(child)
    return None


def _probe(model: nn.Module) -> mx.array:
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model))
    mx.eval(logits)
    return logits


def use_input_major_weights(model: nn.Module) -> int:
    """Swap every dense Linear (and an Embedding used as a tied head) in place.

    Returns how many modules were swapped. The model is run on a short probe before and
    after; if it fails or disagrees afterwards (a model that reads .weight directly),
    every swap is undone and 0 is returned.
    """
    tied = bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))
    before = _probe(model)
    undo: list[tuple[object, object, object]] = []  # (container, key, original)
    for _, parent in model.named_modules():
        for name, child in parent.children().items():
            if isinstance(child, list):
                for i, item in enumerate(child):
                    new = _swap_for(item, tied)
                    if new is not None:
                        undo.append((child, i, item))
                        child[i] = new
            else:
                new = _swap_for(child, tied)
                if new is not None:
                    undo.append((parent, name, child))
                    parent[name] = new
    if not undo:
        return 0
    mx.eval(model.parameters())
    try:
        ok = mx.allclose(_probe(model), before, rtol=1e-3, atol=1e-3).item()
    except Exception:
        ok = False
    if not ok:
        for container, key, original in reversed(undo):
            container[key] = original
        return 0
    return len(undo)


def on_cpu() -> bool:
    """Whether arrays are computed on the CPU by default."""
    return mx.default_device() == mx.cpu
