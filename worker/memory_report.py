"""What a loaded model's memory is: its weights, its KV cache, and the rest (issue 25).

Why: a user sizing a machine for a model needs the three figures llama.cpp prints at load, not
only the worker's resident set. They are said once in the load log and announced to the gateway,
which lists them in ``/v1/models`` (``memory``, docs/api.md):

- ``weights_bytes``: every weight the model holds: mlx's parameters, the packed copies the
  native decode kernels read (loading/packed.py) and the GGUF blocks kept in place
  (loading/ggml_blocks.py); ``weights_mapped_bytes`` is the part that is the memory-mapped file
  itself (pages shared with the page cache, which the kernel may drop and read again). Matrices
  read into panels (every type the kernels read, where the build has panel loops) are as large as
  the file's blocks: the process's own memory at a file's first start, and
  mapped too at later ones, from the panels kept on disk (loading/panel_cache.py).
- ``kv_cache_bytes``: the keys and values of one sequence at the served context window
  (``kv_bytes_per_token`` times the window), in the dtype the model computes in, or in the 8-bit
  layout where ``--kv-cache int8`` took (engine/kv_int8.py: 36 bytes per 32 values); each running
  request holds its own, up to ``max_batch``, and the prompt cache up to ``cache_bytes`` more.
- ``other_bytes``: the resident set when the worker is ready, less the weights' part of it: the
  runtime (Python, mlx, the tokenizer) and its buffers. A mapped matrix's part is its pages
  this process has mapped in (memory.resident_part), which at a start that maps kept panels may
  be few of them;
  taking all of it off gave "the rest 0 MB". ``rss_bytes`` is that resident set.

The KV figure is computed from the model's shape (layers, KV heads, head width), not measured:
architectures with sliding-window layers (Gemma) hold less than it says on those layers.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .engine.kv_int8 import INT8, position_bytes
from .loading.parameters import flat_parameters
from .memory import resident_bytes, resident_part

log = logging.getLogger("kiln.worker.loading")


def _weights(model: nn.Module) -> tuple[int, list[np.ndarray]]:
    """(all weight bytes, the arrays that are a mapped file's pages) of a loaded model."""
    from .loading.ggml_blocks import ggml_weights

    total = sum(v.nbytes for _, v in flat_parameters(model) if isinstance(v, mx.array))
    mapped: list[np.ndarray] = []
    seen: set[int] = set()
    for _, module in model.named_modules():
        blocks = ggml_weights(module)
        if blocks is not None and id(blocks.blocks) not in seen:
            seen.add(id(blocks.blocks))
            total += blocks.blocks.nbytes
            if blocks.mapped:  # the GGUF's blocks or kept panels, not the process's own memory
                mapped.append(blocks.blocks)
        packed = getattr(module, "_packed", None)
        if packed is not None and id(packed) not in seen:
            seen.add(id(packed))
            total += packed.q.nbytes + packed.scales.nbytes + packed.biases.nbytes
    return total, mapped


def _compute_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype activations (and so the KV cache) take: the embedding's output dtype."""
    embed = getattr(getattr(model, "model", model), "embed_tokens", None)
    for name in ("scales", "weight"):  # a quantized embedding's scales, else a dense weight
        value = getattr(embed, name, None) if embed is not None else None
        if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32  # GGUF blocks: dequantized to float32


def kv_bytes_per_token(model: nn.Module, kv_int8: bool = False) -> int | None:
    """Keys and values one token takes in every layer, or None where the shape is not known."""
    args = getattr(model, "args", None)
    layers = getattr(args, "num_hidden_layers", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    hidden = getattr(args, "hidden_size", None)
    head_dim = getattr(args, "head_dim", None) or (hidden // heads if heads and hidden else None)
    if not (layers and kv_heads and head_dim):
        return None
    if kv_int8:
        return 2 * int(layers) * int(kv_heads) * position_bytes(INT8, int(head_dim))
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * _compute_dtype(model).size


def memory_report(model: nn.Module, context_window: int, kv_int8: bool = False) -> dict[str, int]:
    """The figures of the module docstring, measured now (call it once the engine is ready)."""
    weights, mapped_arrays = _weights(model)
    mapped = sum(a.nbytes for a in mapped_arrays)
    per_token = kv_bytes_per_token(model, kv_int8)
    rss = resident_bytes()
    # The weights' share of the resident set: the process's own copies whole, the mapped ones as
    # far as their pages are in (where that cannot be asked, as if all were).
    in_memory = resident_part(mapped_arrays)
    held = weights - mapped + (mapped if in_memory is None else min(in_memory, mapped))
    report = {"weights_bytes": weights, "weights_mapped_bytes": mapped, "rss_bytes": rss, "other_bytes": max(0, rss - held)}
    if per_token is not None:
        report.update(kv_bytes_per_token=per_token, kv_cache_bytes=per_token * context_window, context_window=context_window)
    return report


def log_memory(model_id: str, report: dict[str, Any]) -> None:
    """The load log's memory line, e.g. "memory: weights 671 MB (671 MB mapped from the file), KV
    cache 268 MB a sequence at 8192 tokens, the rest 140 MB (resident 812 MB)"."""

    def mb(key: str) -> float:
        return float(report.get(key, 0)) / 1e6

    kv = f"KV cache {mb('kv_cache_bytes'):.0f} MB a sequence at {report['context_window']} tokens" if "kv_cache_bytes" in report else "KV cache size unknown"
    log.info(
        "memory of %s: weights %.0f MB (%.0f MB mapped from the file), %s, the rest %.0f MB (resident %.0f MB)",
        model_id, mb("weights_bytes"), mb("weights_mapped_bytes"), kv, mb("other_bytes"), mb("rss_bytes"),
        extra={"memory": report},
    )  # fmt: skip
