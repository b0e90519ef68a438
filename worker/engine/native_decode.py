"""A decode step for llama-style models on the CPU, outside mlx's graph.

Why: on the CPU mlx runs every small op of a decode step (norms, rope, the attention over a
few hundred keys, SwiGLU) as its own task on its own thread, and with the weights' matmuls
done by the native kernel (loading/packed.py) the step is dominated by those hand-offs: a
decode step of SmolLM2 spent ~25 ms waiting on ~20 tiny mlx ops per layer. Here the same
arithmetic runs in numpy on the calling thread, the matmuls in the native kernel, and mlx is
used for one thing only: appending each layer's new keys and values to mlx-lm's
BatchKVCache, so the prefix cache, row extraction and the prefill path (all mlx) see exactly
the cache they always did.

It handles mlx-lm's ``llama`` (SmolLM2, Llama, Mistral), ``qwen2`` (q/k/v biases) and
``qwen3`` (per-head q/k norms) models when every projection and the output head are packed and
RoPE is the plain kind; anything else decodes through mlx as before. ``build`` checks its
output against the mlx forward pass on the real weights before it is used, so a model that
only looks alike is refused rather than decoded wrongly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache

from ..loading.packed import PackedEmbedding, PackedLinear, PackedWeights

log = logging.getLogger(__name__)

# mlx-lm model classes whose decoder blocks the native step reproduces (checked numerically at
# build time all the same).
_MODELS = (llama.Model, qwen2.Model, qwen3.Model)
_MLPS = (llama.MLP, qwen2.MLP, qwen3.MLP)


@dataclass
class _Layer:
    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    q: PackedWeights
    k: PackedWeights
    v: PackedWeights
    o: PackedWeights
    gate: PackedWeights
    up: PackedWeights
    down: PackedWeights
    qkv_bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # Qwen2
    qk_norm: tuple[np.ndarray, np.ndarray] | None = None  # Qwen3: per-head RMSNorm before RoPE


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities, float32."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _packed(module: nn.Module) -> PackedWeights | None:
    """The packed weights of a PackedLinear (bias or not), else None."""
    return module._packed if type(module) is PackedLinear else None


def _layer(block: nn.Module, eps: float) -> _Layer | None:
    """A transformer block's parts as the native step uses them, or None if it differs from the
    llama/Qwen2/Qwen3 block in a way the step does not handle."""
    attn, mlp = block.self_attn, block.mlp
    if type(mlp) not in _MLPS or type(attn.rope) is not nn.RoPE:
        return None
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    parts = [_packed(m) for m in projections]
    norms = [block.input_layernorm, block.post_attention_layernorm]
    qk_norm = None
    if hasattr(attn, "q_norm"):
        norms += [attn.q_norm, attn.k_norm]
        qk_norm = (np.asarray(attn.q_norm.weight), np.asarray(attn.k_norm.weight))
    if any(p is None for p in parts) or any(type(n) is not nn.RMSNorm or n.eps != eps for n in norms):
        return None
    biased = ["bias" in m for m in projections]
    if any(biased[3:]) or len(set(biased[:3])) > 1:
        return None
    qkv_bias = tuple(np.asarray(m.bias) for m in projections[:3]) if biased[0] else None
    if attn.rope.dims * attn.n_heads != parts[0].out_dims:
        return None
    return _Layer(np.asarray(norms[0].weight), np.asarray(norms[1].weight), *parts, qkv_bias=qkv_bias, qk_norm=qk_norm)


class NativeDecoder:
    """Logits for one new token per row, given mlx-lm BatchKVCaches holding each row's past."""

    def __init__(self, model: llama.Model, layers: list[_Layer], head: PackedWeights) -> None:
        inner = model.model
        attn = inner.layers[0].self_attn
        self.max_rows = head.kernel.max_rows
        self._embedding = np.asarray(inner.embed_tokens.weight)
        self._layers = layers
        self._final_norm = np.asarray(inner.norm.weight)
        self._eps = inner.norm.eps
        self._head = head
        self._kernels = head.kernel
        self._heads, self._kv_heads, self._head_dim = attn.n_heads, attn.n_kv_heads, attn.rope.dims
        self._scale = attn.scale
        rope = attn.rope
        half = rope.dims // 2
        self._inv_freq = rope.base ** (-np.arange(half, dtype=np.float64) / half)
        self._rope_scale = rope.scale
        self._traditional = rope.traditional

    @classmethod
    def build(cls, model: nn.Module) -> NativeDecoder | None:
        """The decoder for ``model``, or None where it does not apply or does not match mlx."""
        if type(model) not in _MODELS:
            return None
        inner = model.model
        if getattr(inner, "swa_idx", None) is not None or getattr(inner, "pipeline_size", 1) != 1 or not inner.layers:
            return None
        if type(inner.norm) is not nn.RMSNorm:
            return None
        if type(inner.embed_tokens) not in (nn.Embedding, PackedEmbedding) or inner.embed_tokens.weight.dtype != mx.float32:
            return None
        head_module = inner.embed_tokens if model.args.tie_word_embeddings else model.get("lm_head")
        if type(head_module) is PackedEmbedding:
            head = head_module._packed
        else:
            head = _packed(head_module) if head_module is not None and "bias" not in head_module else None
        if head is None:
            return None
        layers = [_layer(block, inner.norm.eps) for block in inner.layers]
        if any(layer is None for layer in layers):
            return None
        decoder = cls(model, layers, head)
        if not decoder._matches(model):
            log.warning("native decode step disagrees with mlx on this model: decoding through mlx")
            return None
        return decoder

    def _matches(self, model: nn.Module) -> bool:
        """Two rows (one left-padded) decoded both ways after the same prefill agree."""
        prompts = [[1 + (7 * i) % 97 for i in range(12)], [3 + (5 * i) % 89 for i in range(9)]]
        logits = []
        for native in (False, True):
            cache = [BatchKVCache([0, 3]) for _ in model.model.layers]
            padded = [prompts[0], [0, 0, 0] + prompts[1]]
            model(mx.array(padded), cache=cache)
            step = mx.array([[5], [11]])
            logits.append(self(step, cache) if native else np.array(model(step, cache=cache)[:, -1, :]))
        ref, ours = logits
        return bool(np.allclose(ours, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max())))

    # ---- the step --------------------------------------------------------------------------

    def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x: (B, heads, d); cos/sin: (B, 1, d/2). Rotates pairs (2i, 2i+1) ("traditional",
        as GGUF llamas are loaded) or (i, i + d/2)."""
        if self._traditional:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2] = x1 * cos - x2 * sin
            out[..., 1::2] = x1 * sin + x2 * cos
            return out
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    @staticmethod
    def _append(c: BatchKVCache, k: np.ndarray, v: np.ndarray, offset: mx.array) -> tuple[np.ndarray, np.ndarray]:
        """Add one position (k, v: (B, KVH, 1, d)) to the cache; return all its keys and values.

        Where the cache's buffers have room and are plain contiguous arrays, the new position
        is written into them in place: nothing in mlx refers to a position at or past _idx
        (extracted rows and fetched views end before it), and it saves an mlx slice update
        and a wait for mlx's thread per layer. Otherwise mlx-lm's update_and_fetch grows them.
        """
        keys = np.asarray(c.keys) if c.keys is not None else None
        values = np.asarray(c.values) if c.values is not None else None
        if keys is None or values is None or c._idx >= keys.shape[2] or not all(
            a.flags.c_contiguous and a.flags.writeable for a in (keys, values)
        ):
            fetched = c.update_and_fetch(mx.array(k), mx.array(v))
            mx.eval(fetched)
            return np.asarray(fetched[0]), np.asarray(fetched[1])
        keys[:, :, c._idx] = k[:, :, 0]
        values[:, :, c._idx] = v[:, :, 0]
        c._idx += 1
        c.offset = offset
        return keys[:, :, : c._idx], values[:, :, : c._idx]

    def __call__(self, tokens: mx.array, cache: list[BatchKVCache]) -> np.ndarray:
        """tokens: (B, 1) with B <= max_rows. Returns the logits (B, vocab)."""
        first = cache[0]
        mx.eval(tokens, first.offset, first.left_padding, [(c.keys, c.values) for c in cache if c.keys is not None])
        next_offset = first.offset + 1  # every layer's offset is the same array
        ids = np.asarray(tokens).reshape(-1)
        positions = np.asarray(first.offset).astype(np.float64)
        rows = ids.shape[0]
        angles = (positions[:, None] * self._rope_scale) * self._inv_freq[None, :]
        cos = np.cos(angles).astype(np.float32)[:, None, :]
        sin = np.sin(angles).astype(np.float32)[:, None, :]
        # Keys before left_padding[b] are row b's padding.
        start = np.asarray(first.left_padding)

        h = self._embedding[ids]
        heads, kv_heads, d = self._heads, self._kv_heads, self._head_dim
        for layer, c in zip(self._layers, cache):
            x = _rms_norm(h, layer.attn_norm, self._eps)
            q, k, v = layer.q.apply(x), layer.k.apply(x), layer.v.apply(x)
            if layer.qkv_bias is not None:
                q, k, v = q + layer.qkv_bias[0], k + layer.qkv_bias[1], v + layer.qkv_bias[2]
            q, k, v = q.reshape(rows, heads, d), k.reshape(rows, kv_heads, d), v.reshape(rows, kv_heads, 1, d)
            if layer.qk_norm is not None:
                q, k = _rms_norm(q, layer.qk_norm[0], self._eps), _rms_norm(k, layer.qk_norm[1], self._eps)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            keys, values = self._append(c, k[:, :, None, :], v, next_offset)
            attended = self._kernels.attention(q, keys, values, start, self._scale).reshape(rows, -1)
            h = h + layer.o.apply(attended)
            x = _rms_norm(h, layer.mlp_norm, self._eps)
            gate = layer.gate.apply(x)
            h = h + layer.down.apply(gate / (1.0 + np.exp(-gate)) * layer.up.apply(x))
        return self._head.apply(_rms_norm(h, self._final_norm, self._eps))
