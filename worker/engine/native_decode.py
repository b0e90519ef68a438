"""The forward pass of llama-style models on the CPU, outside mlx's graph, in one native call.

Why: on the CPU mlx runs every small op of a decode step (norms, rope, the attention over a
few hundred keys, SwiGLU) as its own task on its own thread; a decode step of SmolLM2 spent
~25 ms waiting on ~20 tiny mlx ops per layer. Then numpy between C matmuls still cost a
Python hop per op. Now the whole pass (embedding to logits) is one call into decode.c
(worker/native): every product split over the cores by output columns, with 8-bit activations
and integer dot products where the CPU has them. mlx-lm's BatchKVCache stays the source of
truth: the pass writes each layer's new keys and values into the cache's own buffers (numpy
views of its mlx arrays), growing them (through mlx) when full, so the prefix cache, row
extraction and the prefill path (all mlx) see exactly the cache they always did.

It handles mlx-lm's ``llama`` (SmolLM2, Llama, Mistral), ``qwen2`` (q/k/v biases) and
``qwen3`` (per-head q/k norms) models when every projection and the output head are packed and
RoPE is mlx's plain kind (traditional or not) or Llama 3's ``rope_freqs`` (FactorRoPE); anything
else decodes through mlx as before.
``build`` checks the pass against mlx's forward pass on the real weights before it is used
(see ``Tolerance``), so a model that only looks alike is refused rather than decoded wrongly.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache

from ..loading.ggml_blocks import GGMLEmbedding, GGMLLinear, GGMLWeights, ggml_weights
from ..loading.gguf import FactorRoPE
from ..loading.packed import PackedEmbedding, PackedLinear, PackedWeights
from ..native.build import CpuKernels
from ..native.structs import CACHE_FIELDS, Layer, Model, QuantizedWeights, floats
from . import kv_int8
from .kv_int8 import KVCacheType

log = logging.getLogger(__name__)

# mlx-lm model classes whose decoder blocks the native pass reproduces (checked numerically at
# build time all the same).
_MODELS = (llama.Model, qwen2.Model, qwen3.Model)
_MLPS = (llama.MLP, qwen2.MLP, qwen3.MLP)
# Rows x new tokens of one call; decode batches are at most the scheduler's batch size.
MAX_TOKENS = 256
# Tokens of one long prompt's chunk that the pass takes where its products of a GGUF's blocks
# go through the GEMM (worker/native/gemm.c) or the panel loops (panels.c): 512 rows keep the
# cost of decoding each column tile of the weights small beside multiplying it, for ~90 MB of
# scratch on a 1B model.
PREFILL_TOKENS = 512
# decode.c's mask of the products that take 8-bit activations (q/k/v 1, o 2, gate/up 4, down 8,
# head 16): all of them.
_INT8_ALL = 31
# "float32" keeps the activations in float32 where the CPU has integer dot products too: the
# products then match mlx's up to the order of float sums, greedy output token for token.
ACTIVATIONS_ENV = "KILN_NATIVE_ACTIVATIONS"


@dataclass(frozen=True)
class Tolerance:
    """How close the native pass must come to mlx's forward pass on the build check.

    Measured on next-token distributions rather than raw logits: ``kl`` bounds the KL
    divergence KL(mlx || native) in nats at every checked position, and the greedy token must be
    mlx's wherever mlx's best token beats its runner-up by more than ``decided`` nats of
    log-probability (closer than that, which of two nearly equal tokens wins is decided by
    rounding, in float32 sums as much as in 8-bit activations).

    float32 activations differ from mlx only in the order of float sums (KL ~1e-9). 8-bit
    activations round each value to 1/254 of its block's largest: the product is then exactly
    that of the weights with the rounded values, off by about sqrt(n / 3) / 254 of
    max|x| * |w| for n terms; through a model's layers that measured a KL of ~0.003 nats
    (max 0.006) on SmolLM2-135M, and 0.001-0.04 on the tests' tiny random models, whose
    weights are scaled up to make their output wander. 0.05 nats is taken as the bound: a
    model past it (an activation outlier that one block's scale cannot hold) falls back to
    float32 activations, and then to mlx.
    """

    kl: float
    decided: float

    def agree(self, ours: np.ndarray, ref: np.ndarray) -> bool:
        mine, theirs = log_softmax(ours.astype(np.float64)), log_softmax(ref.astype(np.float64))
        kl = (np.exp(theirs) * (theirs - mine)).sum(axis=-1)
        runner_up, best = np.moveaxis(np.sort(theirs, axis=-1)[..., -2:], -1, 0)
        decided = best - runner_up > self.decided
        return bool(kl.max() <= self.kl) and bool(np.all((ours.argmax(-1) == ref.argmax(-1)) | ~decided))


FLOAT32 = Tolerance(kl=1e-5, decided=1e-3)
INT8 = Tolerance(kl=0.05, decided=0.1)
# The 8-bit KV cache against the same pass with the float32 cache (which passed INT8 against
# mlx): every layer's keys and values rounded to 1/254 of their block's largest, read by every
# later position. Measured: KL ~0.1 nats on the tests' tiny random models (as chaotic as INT8's
# note says: 8-bit activations alone move them 0.02), 0.001 on 1B-shaped random GGUFs. A wrong
# cache layout or scale gives tens of nats.
KV8 = Tolerance(kl=0.25, decided=0.5)


# A matrix as the pass reads it: mlx's affine layout (packed.py) or a GGUF's blocks (ggml_blocks.py).
Weights = PackedWeights | GGMLWeights


@dataclass
class _Layer:
    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    q: Weights
    k: Weights
    v: Weights
    o: Weights
    gate: Weights
    up: Weights
    down: Weights
    qkv_bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # Qwen2
    qk_norm: tuple[np.ndarray, np.ndarray] | None = None  # Qwen3: per-head RMSNorm before RoPE


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities, float32."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    out: np.ndarray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return out


def _packed(module: nn.Module) -> Weights | None:
    """The weights of a PackedLinear or GGMLLinear (bias or not), else None."""
    if type(module) is GGMLLinear:
        return ggml_weights(module)
    return module._packed if type(module) is PackedLinear else None


def _same_input(parts: list[Weights]) -> bool:
    """Products of one input share its 8-bit form: GGUF blocks of any type (one form for all),
    or mlx's layout with the same bits and groups, which the loops take as 32 or a multiple of 64."""
    blocks = [isinstance(p, GGMLWeights) for p in parts]
    if any(blocks):
        return all(blocks)
    first = parts[0]
    assert isinstance(first, PackedWeights)
    return all(isinstance(p, PackedWeights) and p.bits == first.bits and p.group_size == first.group_size for p in parts) and (
        first.group_size == 32 or first.group_size % 64 == 0
    )


def _layer(block: nn.Module, eps: float) -> _Layer | None:
    """A transformer block's parts as the native pass uses them, or None if it differs from the
    llama/Qwen2/Qwen3 block in a way the pass does not handle."""
    attn, mlp = block.self_attn, block.mlp
    if type(mlp) not in _MLPS or rope_frequencies(attn.rope) is None:
        return None
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    found = [_packed(m) for m in projections]
    parts = [p for p in found if p is not None]
    norms = [block.input_layernorm, block.post_attention_layernorm]
    qk_norm = None
    if hasattr(attn, "q_norm"):
        norms += [attn.q_norm, attn.k_norm]
        qk_norm = (np.asarray(attn.q_norm.weight), np.asarray(attn.k_norm.weight))
    if len(parts) < len(found) or any(type(n) is not nn.RMSNorm or n.eps != eps for n in norms):
        return None
    if not all(_same_input(group) for group in (parts[:3], parts[3:4], parts[4:6], parts[6:])):
        return None
    biased = ["bias" in m for m in projections]
    if any(biased[3:]) or len(set(biased[:3])) > 1:
        return None
    q_proj, k_proj, v_proj = projections[:3]
    qkv_bias = (np.asarray(q_proj.bias), np.asarray(k_proj.bias), np.asarray(v_proj.bias)) if biased[0] else None
    if attn.rope.dims * attn.n_heads != parts[0].out_dims or attn.rope.dims % 2 or attn.n_heads % attn.n_kv_heads:
        return None
    q, k, v, o, gate, up, down = parts
    return _Layer(np.asarray(norms[0].weight), np.asarray(norms[1].weight), q, k, v, o, gate, up, down, qkv_bias=qkv_bias, qk_norm=qk_norm)


def rope_frequencies(rope: nn.Module) -> tuple[np.ndarray, bool] | None:
    """The RoPE module's angle per position of each rotated pair (float64, what the pass
    multiplies positions by) and whether pairs are adjacent (traditional), or None for a kind
    the pass does not take. mlx's plain RoPE turns pair i by scale * base^(-i / half); Llama 3's
    ``rope_freqs`` files (FactorRoPE) by 1 / wavelength_i, the factors already in the wavelengths."""
    if type(rope) is nn.RoPE:
        half = rope.dims // 2
        return rope.scale * rope.base ** (-np.arange(half, dtype=np.float64) / half), bool(rope.traditional)
    if type(rope) is FactorRoPE:
        wavelengths = np.asarray(rope.wavelengths, dtype=np.float64)
        if wavelengths.shape != (rope.dims // 2,) or not np.all(np.isfinite(wavelengths) & (wavelengths > 0)):
            return None
        return 1.0 / wavelengths, True
    return None


def _weights(p: Weights, bias: np.ndarray | None = None) -> QuantizedWeights:
    if isinstance(p, GGMLWeights):
        return QuantizedWeights.of_blocks(p.blocks, p.type_id, p.in_dims, floats(bias))
    return QuantizedWeights.of(p.q, p.scales, p.biases, p.bits, p.group_size, floats(bias))


def _vocab(embedding: nn.Module) -> int:
    vocab: int = embedding.num_embeddings if type(embedding) is GGMLEmbedding else embedding.weight.shape[0]
    return vocab


def _blocks_line(layers: list[_Layer], head: Weights, embedding: nn.Module) -> str:
    """E.g. "; GGUF blocks: Q4_K x 96, Q6_K x 17" (products and the embedding), or ""."""
    parts: list[Weights] = [head] + [getattr(layer, n) for layer in layers for n in ("q", "k", "v", "o", "gate", "up", "down")]
    names = [p.type_name for p in parts if isinstance(p, GGMLWeights)]
    if type(embedding) is GGMLEmbedding and (embedding._ggml is not head):
        names.append(embedding._ggml.type_name)
    if not names:
        return ""
    return "; GGUF blocks: " + ", ".join(f"{t} x {names.count(t)}" for t in sorted(set(names)))


class NativeDecoder:
    """Logits for new tokens of each row, given mlx-lm BatchKVCaches holding each row's past."""

    def __init__(self, model: nn.Module, layers: list[_Layer], head: Weights, int8: bool, kv: KVCacheType = "float32") -> None:
        inner = model.model
        attn = inner.layers[0].self_attn
        self.max_rows = MAX_TOKENS
        self.int8 = int8  # 8-bit activations (else float32) for mlx-layout products
        # Products of GGUF blocks always take 8-bit activations: then so does the check.
        self.blocks = _blocks_line(layers, head, inner.embed_tokens)
        self._kernels: CpuKernels = head.kernel
        # A long prompt's chunk this pass takes (0: long prompts go through mlx): with a GGUF's
        # blocks and the GEMM (AVX-512), or the panel loops 8 rows a tile (AVX-VNNI, AVX2), the
        # pass's products beat mlx's (dequantized pieces through BLAS).
        self.prefill_rows = PREFILL_TOKENS if self.blocks and (self._kernels.gemm or self._kernels.panels) else 0
        self._lib = self._kernels.library
        self._heads, self._kv_heads, self._head_dim = attn.n_heads, attn.n_kv_heads, attn.rope.dims
        # The 8-bit cache (kv_int8.py), which only this pass reads: then it takes every step,
        # prefill chunks (prefill_rows) and decode batches up to that many tokens alike.
        self.kv_int8 = kv == "int8"
        if self.kv_int8:
            self.max_rows = max(self.max_rows, self.prefill_rows)
        self._kv_kind = kv_int8.INT8 if self.kv_int8 else kv_int8.FLOAT32
        self._kv_dtype = np.uint8 if self.kv_int8 else np.float32
        self._kv_width = kv_int8.position_bytes(self._kv_kind, self._head_dim) // np.dtype(self._kv_dtype).itemsize
        # The build check's reference: mlx, or (for the 8-bit cache) this pass with float32's.
        self._reference: NativeDecoder | None = None
        self._vocab = _vocab(inner.embed_tokens)
        rope = attn.rope
        frequencies = rope_frequencies(rope)
        assert frequencies is not None  # _layer took only RoPE kinds it knows
        self._inv_freq, traditional = frequencies
        embed_blocks = ggml_weights(inner.embed_tokens)
        self._embedding = None if embed_blocks is not None else floats(np.asarray(inner.embed_tokens.weight))
        self._embed_q = _weights(embed_blocks) if embed_blocks is not None else QuantizedWeights()
        self._final_norm = floats(np.asarray(inner.norm.weight))
        keep: list[object] = []
        structs = []
        for layer in layers:
            bias = layer.qkv_bias or (None, None, None)
            norms = [floats(a) for a in (layer.attn_norm, layer.mlp_norm, *(layer.qk_norm or (None, None)))]
            weights = [_weights(p, b) for p, b in zip((layer.q, layer.k, layer.v), bias, strict=False)] + [_weights(p) for p in (layer.o, layer.gate, layer.up, layer.down)]
            # ctypes copies the structs' fields into the array; the arrays they point into stay
            # alive through `keep` (the norms, and each QuantizedWeights' own _keep).
            keep.append((norms, weights))
            structs.append(Layer(*(None if a is None else a.ctypes.data for a in norms), *weights))
        self._layer_array = (Layer * len(structs))(*structs)
        self._keep = keep
        self._head = _weights(head)
        self._model = Model(
            len(layers), self._final_norm.shape[0], layers[0].gate.out_dims, self._heads, self._kv_heads,
            self._head_dim, self._vocab, int(traditional), inner.norm.eps, attn.scale,
            self._inv_freq.ctypes.data, None if self._embedding is None else self._embedding.ctypes.data,
            self._final_norm.ctypes.data, self._head, self._layer_array, self._embed_q,
        )  # fmt: skip
        self._work = np.empty(0, np.float32)

    @classmethod
    def build(cls, model: nn.Module, kv: KVCacheType = "float32") -> NativeDecoder | None:
        """The decoder for ``model``, or None where it does not apply or does not match mlx.

        kv "int8" asks for the 8-bit cache: kept where the pass takes every step (a GGUF's blocks
        with the GEMM or panel loops) and passes its check with it, else the float32 cache, with
        a log line."""
        if type(model) not in _MODELS:
            return None
        inner = model.model
        if getattr(inner, "swa_idx", None) is not None or getattr(inner, "pipeline_size", 1) != 1 or not inner.layers:
            return None
        if type(inner.norm) is not nn.RMSNorm:
            return None
        embedding = inner.embed_tokens
        if type(embedding) is not GGMLEmbedding and (type(embedding) not in (nn.Embedding, PackedEmbedding) or embedding.weight.dtype != mx.float32):
            return None
        head_module = embedding if model.args.tie_word_embeddings else model.get("lm_head")
        head: Weights | None
        if type(head_module) is PackedEmbedding:
            head = head_module._packed
        elif type(head_module) is GGMLEmbedding:
            head = ggml_weights(head_module)
        else:
            head = _packed(head_module) if head_module is not None and "bias" not in head_module else None
        if head is None or not _same_input([head]):
            return None
        found = [_layer(block, inner.norm.eps) for block in inner.layers]
        layers = [layer for layer in found if layer is not None]
        if len(layers) < len(found):
            return None
        int8_first = head.kernel.int8 and os.environ.get(ACTIVATIONS_ENV, "int8").strip().lower() != "float32"
        log.info("checking the native decode pass (%s build) against mlx", head.kernel.variant)
        for int8 in (True, False) if int8_first else (False,):
            decoder = cls(model, layers, head, int8)
            if decoder._matches(model):
                if kv == "int8":
                    decoder = decoder._with_8_bit_cache(model, layers, head)
                log.info("native decode pass: %s build, %s activations, %s KV cache%s", head.kernel.variant, "8-bit" if int8 else "float32", "8-bit" if decoder.kv_int8 else "float32", decoder.blocks)
                return decoder
            log.warning("native forward pass (%s activations) disagrees with mlx on this model", "8-bit" if int8 else "float32")
        log.warning("decoding through mlx")
        return None

    def _with_8_bit_cache(self, model: nn.Module, layers: list[_Layer], head: Weights) -> NativeDecoder:
        """This pass with the 8-bit cache where it can take it and agrees with this one (``KV8``),
        else this one. It can where it runs every step (``prefill_rows``: a GGUF's blocks with the
        GEMM or panel loops), since mlx cannot read the cache, and its heads are whole blocks."""
        if not self.prefill_rows or self._head_dim % kv_int8.BLOCK:
            log.warning(
                "--kv-cache int8 needs the native pass to run every step (a GGUF's blocks, a build with the GEMM or panel loops) and a head size that is a multiple of %d: float32 cache",
                kv_int8.BLOCK,
            )
            return self
        candidate = type(self)(model, layers, head, self.int8, "int8")
        candidate._reference = self
        if candidate._matches(model):
            return candidate
        log.warning("the native pass with an 8-bit KV cache strays past its bound from the float32 cache's on this model: float32 cache")
        return self

    def _matches(self, model: nn.Module) -> bool:
        """Two rows (one left-padded) prefilled by mlx, then three new tokens at once and three
        single steps, agree with mlx's forward pass on the same cache (within ``Tolerance``).

        The prefill runs once and each side steps from its own copy of that cache: on a GGUF's
        blocks mlx's pass reads every matrix, so a second prefill was a third of the check's
        time (44 s of a first start of an 8B file)."""
        prompts = [[1 + (7 * i) % 97 for i in range(12)], [3 + (5 * i) % 89 for i in range(9)]]
        padded = mx.array([prompts[0], [0, 0, 0] + prompts[1]])
        steps = [mx.array([[5, 17, 2], [11, 4, 29]])] + [mx.array([[t], [t + 7]]) for t in (13, 3, 41)]
        prefilled = [BatchKVCache([0, 3]) for _ in model.model.layers]
        model(padded, cache=prefilled)
        mx.eval([c.state[:4] for c in prefilled])
        results: list[list[np.ndarray]] = [[], []]
        for native in (False, True):
            cache = [BatchKVCache([0, 3]) for _ in model.model.layers]
            for c, done in zip(cache, prefilled, strict=True):
                keys, values, offset, left_padding, idx = done.state
                c.state = (mx.array(keys), mx.array(values), mx.array(offset), mx.array(left_padding), idx)  # copies: the pass writes in place
            for step in steps:
                step = step % self._vocab
                if native:
                    results[native].append(self.forward(step, cache))
                elif self._reference is not None:
                    results[native].append(self._reference.forward(step, cache))
                else:
                    # mx.eval lets go of the GIL while mlx computes (converting a lazy array
                    # does not): the worker's heartbeat thread keeps running during the check.
                    logits = model(step, cache=cache)
                    mx.eval(logits)
                    results[native].append(np.array(logits))
        tolerance = KV8 if self._reference is not None else INT8 if self.int8 or self.blocks else FLOAT32
        return all(tolerance.agree(ours, ref) for ref, ours in zip(*results, strict=False))

    # ---- the pass --------------------------------------------------------------------------

    def _room(self, c: BatchKVCache, rows: int, new: int) -> tuple[np.ndarray, np.ndarray]:
        """The cache's key and value buffers as writable numpy views with room for ``new`` more
        positions, replaced first (keeping their contents) where they are not contiguous buffers
        of this pass's cache kind with that room: nothing in mlx refers to a position at or past
        ``_idx`` (extracted rows and fetched views end before it), so the pass may write there.
        A float32 cache that mlx wrote (the build check's prefill) is rounded to 8 bits here
        where the pass keeps an 8-bit one."""
        keys = None if c.keys is None else np.asarray(c.keys)
        values = None if c.values is None else np.asarray(c.values)
        need = c._idx + new
        if keys is not None and values is not None and all(
            a.dtype == self._kv_dtype and a.shape[3] == self._kv_width and a.flags.c_contiguous and a.flags.writeable and a.shape[2] >= need for a in (keys, values)
        ):
            return keys, values  # usable as they are
        step = BatchKVCache.step
        capacity = (need + step - 1) // step * step
        shape = (rows, self._kv_heads, capacity, self._kv_width)
        grown_k, grown_v = np.zeros(shape, self._kv_dtype), np.zeros(shape, self._kv_dtype)
        if keys is not None and values is not None:
            for grown, old in ((grown_k, keys), (grown_v, values)):
                kept = old[:, :, : c._idx]
                if self.kv_int8 and old.dtype != np.uint8:
                    kept = kv_int8.quantize(kept)
                grown[:, :, : c._idx] = kept
        c.keys, c.values = mx.array(grown_k), mx.array(grown_v)  # type: ignore[assignment]  # mlx_lm's untyped __init__ sets them to None
        mx.eval(c.keys, c.values)
        keys, values = np.asarray(c.keys), np.asarray(c.values)
        return keys, values

    def _run(self, tokens: mx.array | np.ndarray, cache: list[BatchKVCache], head_rows: int) -> np.ndarray | None:
        first = cache[0]
        mx.eval(first.offset, first.left_padding, [(c.keys, c.values) for c in cache if c.keys is not None])
        ids = np.ascontiguousarray(np.asarray(tokens), dtype=np.int32)
        rows, new = ids.shape
        if rows * new > max(self.max_rows, self.prefill_rows):
            raise ValueError(f"{rows} x {new} tokens is more than the native pass takes at once ({max(self.max_rows, self.prefill_rows)})")
        idx = first._idx
        if any(c._idx != idx for c in cache):
            raise ValueError("the layers' caches disagree on their length")
        table = np.empty((len(cache), CACHE_FIELDS), dtype=np.int64)
        for i, c in enumerate(cache):
            keys, values = self._room(c, rows, new)
            table[i] = (keys.ctypes.data, values.ctypes.data, keys.strides[0], keys.strides[1], values.strides[0], values.strides[1], self._kv_kind)
        positions = np.ascontiguousarray(np.asarray(first.offset), dtype=np.int32)
        start = np.ascontiguousarray(np.asarray(first.left_padding), dtype=np.int32)
        out_rows = rows * new if head_rows == 2 else rows if head_rows == 1 else 0
        logits = np.empty((max(out_rows, 1), self._vocab), np.float32)
        model = ctypes.byref(self._model)
        with self._kernels.forward_pass(rows * new):
            # Sized inside: the scratch holds a row of attention scores per thread of this pass.
            need = self._lib.kiln_forward_work(model, rows * new, idx + new)
            if self._work.size < need:
                self._work = np.empty(need, np.float32)
            status = self._lib.kiln_forward(
                model, table.ctypes.data, rows, new, ids.ctypes.data, positions.ctypes.data, start.ctypes.data,
                idx, head_rows, _INT8_ALL if self.int8 else 0, logits.ctypes.data, self._work.ctypes.data,
            )  # fmt: skip
        if status != 0:
            raise ValueError(f"the native forward pass refused {rows} x {new} tokens at cache position {idx}")
        offset = first.offset + new  # every layer's offset is the same array
        for c in cache:
            c._idx += new
            c.offset = offset
        return logits[:out_rows] if out_rows else None

    def __call__(self, tokens: mx.array | np.ndarray, cache: list[BatchKVCache]) -> np.ndarray:
        """tokens: (B, 1). Returns the logits (B, vocab) of each row's new token."""
        logits = self._run(tokens, cache, head_rows=1)
        assert logits is not None
        return logits

    def forward(self, tokens: mx.array | np.ndarray, cache: list[BatchKVCache]) -> np.ndarray:
        """tokens: (B, T), T >= 1 new tokens per row after the cached past, causal among
        themselves (e.g. drafts to verify in one step). Returns the logits (B, T, vocab)."""
        rows, new = np.asarray(tokens).shape
        logits = self._run(tokens, cache, head_rows=2)
        assert logits is not None
        return logits.reshape(rows, new, self._vocab)

    def prefill(self, tokens: mx.array | np.ndarray, cache: list[BatchKVCache]) -> None:
        """Append (B, T) tokens' keys and values to the cache without computing logits."""
        self._run(tokens, cache, head_rows=0)
