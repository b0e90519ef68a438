"""Random-weight GGUFs of real models' exact shapes, quantized by llama.cpp's own llama-quantize.

    python -m bench.model_shapes llama-3.2-1b [--quant Q4_K_M,Q4_0] [--layers N]   # prints the paths

Why: the bundled 135M model fits in cache, so its speed says little about the 1B-8B files users
download (almost always Q4_K_M). Real weights are gigabytes from a hub this machine cannot reach;
speed and memory do not depend on the values, only on the shape and the quantization, so a file
with the real model's shape (hidden size, layers, heads / KV heads, FFN, RoPE base and scaling,
norm epsilon, tied or separate output head) and random weights measures what a user would see.

The tokenizer (vocabulary, merges, chat template, special tokens) is the bundled SmolLM2 model's,
so the vocabulary is 49,152 tokens rather than the real model's (128,256 for Llama 3, 152,064 for
Qwen2.5): the embedding and output head are smaller than the real ones, everything else is the same.
Prompts are the bench's own, tokenized alike by every peer.

Steps, each cached under ``<bench cache>/model-shapes/`` (``bench.convert.cache_root``):
  1. ``<shape>-<key>-F16.gguf``: written with the ``gguf`` package tensor by tensor (weights
     normal(0, 0.02) as float16 from a fixed seed, norms 1.0, float32 like llama.cpp's converter
     writes them, and Llama 3's ``rope_freqs`` as its converter computes it).
  2. ``<shape>-<key>-<QUANT>.gguf``: ``llama-quantize`` (bench/llama_cpp.py: built from the same
     llama-cpp-python sources and CMake options as the llama-server peer) on the F16 file.
The key hashes the shape, the writer's format and the tokenizer file's identity; quantized files
add the llama-quantize build's own key, so a different llama.cpp makes its own files.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .convert import bundled_gguf, cache_root

# Bumped when the writer changes what it writes: old cached files are then not reused.
FORMAT = 1
SEED = 25
WEIGHT_STD = 0.02
# llama-quantize's names for the types the bench offers (F16 and F32 are written, not quantized).
QUANTS = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "F16", "F32")
UNQUANTIZED = ("F16", "F32")
DEFAULT_QUANTS = ("Q4_K_M",)


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's RoPE frequency scaling, which llama.cpp's converter writes as a `rope_freqs` tensor."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def factors(self, head_dim: int, theta: float) -> np.ndarray:
        """The per-frequency divisors, (head_dim / 2,) float32, as convert_hf_to_gguf.py computes them."""
        freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        low_wavelen = self.original_context / self.low_freq_factor
        high_wavelen = self.original_context / self.high_freq_factor
        out = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                out.append(1.0)
            elif wavelen > low_wavelen:
                out.append(self.factor)
            else:
                smooth = (self.original_context / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
                out.append(1.0 / ((1 - smooth) / self.factor + smooth))
        return np.asarray(out, dtype=np.float32)


@dataclass(frozen=True)
class Shape:
    """A model's architecture as its GGUF states it (the values of its config.json)."""

    name: str
    arch: str  # GGUF general.architecture: "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    norm_eps: float
    tied_embeddings: bool
    context: int
    rope_scaling: Llama3Rope | None = None
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def with_layers(self, layers: int | None) -> Shape:
        """The same shape with `layers` decoder blocks (a quicker file; the name says so)."""
        if layers is None or layers == self.layers:
            return self
        if layers < 1:
            raise ValueError("layers must be at least 1")
        return dataclasses.replace(self, name=f"{self.name}-{layers}l", layers=layers)

    def with_plain_rope(self) -> Shape:
        """The same shape without Llama 3's `rope_freqs` (plain RoPE at the same base; the name
        says so). Speed and memory are the same for llama.cpp and for Kiln (its native decode
        pass takes both RoPE kinds); kept for comparisons with figures from before it did."""
        if self.rope_scaling is None:
            return self
        return dataclasses.replace(self, name=f"{self.name}-plainrope", rope_scaling=None)


# From each model's config.json on the Hugging Face hub (meta-llama/Llama-3.2-1B-Instruct,
# Llama-3.2-3B-Instruct, Llama-3.1-8B-Instruct, Qwen/Qwen2.5-7B-Instruct).
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama-3.2-1b", "llama", 2048, 16, 32, 8, 8192, 500000.0, 1e-5, True, 131072, Llama3Rope(32.0)),
        Shape("llama-3.2-3b", "llama", 3072, 28, 24, 8, 8192, 500000.0, 1e-5, True, 131072, Llama3Rope(32.0)),
        Shape("llama-3.1-8b", "llama", 4096, 32, 32, 8, 14336, 500000.0, 1e-5, False, 131072, Llama3Rope(8.0)),
        Shape("qwen2.5-7b", "qwen2", 3584, 28, 28, 4, 18944, 1000000.0, 1e-6, False, 32768, qkv_bias=True),
    )
}


def select(name: str, layers: int | None = None, plain_rope: bool = False) -> Shape:
    """The table's shape `name`, with `layers` blocks and without `rope_freqs` if asked."""
    shape = SHAPES[name].with_layers(layers)
    return shape.with_plain_rope() if plain_rope else shape


def parse_list(text: str, allowed: tuple[str, ...] | dict[str, object], what: str) -> list[str]:
    """A comma-separated selection, each item checked against `allowed` (case kept as the table's)."""
    by_upper = {a.upper(): a for a in allowed}
    out: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item.upper() not in by_upper:
            raise ValueError(f"unknown {what} {item!r}; choose from {', '.join(allowed)}")
        if by_upper[item.upper()] not in out:
            out.append(by_upper[item.upper()])
    if not out:
        raise ValueError(f"no {what} given")
    return out


def _tokenizer_identity(path: Path) -> str:
    st = path.stat()
    return f"{path.name}:{st.st_size}"


def shape_key(shape: Shape, tokenizer: Path) -> str:
    """What the random F16 file depends on: the shape, the writer, the seed, the tokenizer file."""
    ident = json.dumps({"shape": dataclasses.asdict(shape), "format": FORMAT, "seed": SEED, "std": WEIGHT_STD, "tokenizer": _tokenizer_identity(tokenizer)}, sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:10]


def shape_path(shape: Shape, quant: str, *, tokenizer: Path, quantizer_key: str | None = None, root: Path | None = None) -> Path:
    """The cached file of `shape` in `quant`: a quantized file's name also carries the llama-quantize build."""
    key = shape_key(shape, tokenizer)
    if quant not in UNQUANTIZED:
        if quantizer_key is None:
            raise ValueError(f"{quant} needs the llama-quantize build's key")
        key = hashlib.sha256(f"{key}/{quantizer_key}".encode()).hexdigest()[:10]
    return (root or cache_root() / "model-shapes") / f"{shape.name}-{key}-{quant}.gguf"


def _tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) of every tensor, in llama.cpp's converter's order; kind is
    "weight" (random float16), "norm" (ones, float32), "bias" (random float32) or "rope_freqs"."""
    h, hd = shape.hidden, shape.head_dim
    yield "token_embd.weight", (VOCAB_PLACEHOLDER, h), "weight"
    if shape.rope_scaling is not None:
        yield "rope_freqs.weight", (hd // 2,), "rope_freqs"
    for i in range(shape.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,), "norm"
        yield b + "attn_q.weight", (shape.heads * hd, h), "weight"
        yield b + "attn_k.weight", (shape.kv_heads * hd, h), "weight"
        yield b + "attn_v.weight", (shape.kv_heads * hd, h), "weight"
        if shape.qkv_bias:
            yield b + "attn_q.bias", (shape.heads * hd,), "bias"
            yield b + "attn_k.bias", (shape.kv_heads * hd,), "bias"
            yield b + "attn_v.bias", (shape.kv_heads * hd,), "bias"
        yield b + "attn_output.weight", (h, shape.heads * hd), "weight"
        yield b + "ffn_norm.weight", (h,), "norm"
        yield b + "ffn_gate.weight", (shape.ffn, h), "weight"
        yield b + "ffn_up.weight", (shape.ffn, h), "weight"
        yield b + "ffn_down.weight", (h, shape.ffn), "weight"
    yield "output_norm.weight", (h,), "norm"
    if not shape.tied_embeddings:
        yield "output.weight", (VOCAB_PLACEHOLDER, h), "weight"


VOCAB_PLACEHOLDER = -1  # replaced by the tokenizer's vocabulary size


# numpy dtypes of numeric metadata arrays (token types, scores) and GGUF's names for them.
_ARRAY_TYPES = {"<i4": "INT32", "<u4": "UINT32", "<f4": "FLOAT32", "<i8": "INT64", "|u1": "UINT8", "|i1": "INT8"}


def _copy_tokenizer(writer, tokenizer: Path) -> int:
    """Copy every `tokenizer.*` key of `tokenizer` (a GGUF); return its vocabulary size.

    Read with Kiln's own header reader (milliseconds; gguf.GGUFReader takes seconds for a
    50k-token vocabulary). Its values carry Python types, mapped back to GGUF's as llama.cpp's
    converter writes these keys: integers are token ids (uint32), numeric arrays keep their dtype.
    """
    import gguf

    from kiln.worker.loading.gguf_header import read_header

    T = gguf.GGUFValueType
    metadata = read_header(tokenizer).metadata
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, np.ndarray):
            writer.add_key_value(key, value.tolist(), T.ARRAY, sub_type=T[_ARRAY_TYPES[value.dtype.str]])
        elif isinstance(value, list):
            writer.add_key_value(key, value, T.ARRAY, sub_type=T.STRING)
        elif isinstance(value, bool):
            writer.add_key_value(key, value, T.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, T.UINT32)
        elif isinstance(value, float):
            writer.add_key_value(key, value, T.FLOAT32)
        else:
            writer.add_key_value(key, str(value), T.STRING)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{tokenizer} has no tokenizer.ggml.tokens")
    return len(tokens)


def write_shape(shape: Shape, path: Path, *, tokenizer: Path, dtype: str = "F16") -> Path:
    """Write `shape` with random weights and `tokenizer`'s vocabulary to `path` (via a .tmp file)."""
    import gguf

    if dtype not in UNQUANTIZED:
        raise ValueError(f"the writer writes F16 or F32, not {dtype}")
    np_dtype = np.float16 if dtype == "F16" else np.float32
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    a = shape.arch
    writer.add_name(f"{shape.name} (random weights, kiln bench)")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "F16" else gguf.LlamaFileType.ALL_F32)
    if a == "llama":
        writer.add_rope_dimension_count(shape.head_dim)
    vocab = _copy_tokenizer(writer, tokenizer)
    writer.add_vocab_size(vocab)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    specs = [(name, tuple(vocab if d == VOCAB_PLACEHOLDER else d for d in dims), kind) for name, dims, kind in _tensors(shape)]
    for name, dims, kind in specs:
        t = np_dtype if kind == "weight" else np.float32
        writer.add_tensor_info(name, dims, np.dtype(t), int(np.prod(dims)) * np.dtype(t).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(SEED)
    for _name, dims, kind in specs:
        if kind == "norm":
            data = np.ones(dims, np.float32)
        elif kind == "rope_freqs":
            assert shape.rope_scaling is not None
            data = shape.rope_scaling.factors(shape.head_dim, shape.rope_theta)
        else:
            data = rng.standard_normal(dims, dtype=np.float32)
            data *= WEIGHT_STD
            data = data.astype(np_dtype if kind == "weight" else np.float32)
        writer.write_tensor_data(data)
    writer.close()
    tmp.rename(path)
    return path


def quantize(source: Path, dest: Path, quant: str, binary: Path, *, threads: int = 2, log=None) -> Path:
    """`llama-quantize source dest QUANT threads`, into a .tmp file renamed when it succeeded."""
    tmp = dest.with_name(dest.name + ".tmp")
    argv = [str(binary), str(source), str(tmp), quant, str(threads)]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0 or not tmp.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"llama-quantize {quant} failed ({done.returncode}):\n{tail}")
    tmp.rename(dest)
    if log:
        log(f"quantized {dest.name} in {time.monotonic() - started:.0f} s")
    return dest


def ensure(shape: Shape, quant: str, *, log=None) -> Path:
    """The cached file of `shape` in `quant`, written (and quantized) now if missing."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    tokenizer = bundled_gguf()
    base = shape_path(shape, "F16" if quant != "F32" else "F32", tokenizer=tokenizer)
    dest = None
    if quant not in UNQUANTIZED:
        from .llama_cpp import tool_binary

        quantizer = tool_binary("llama-quantize")
        dest = shape_path(shape, quant, tokenizer=tokenizer, quantizer_key=quantizer.key)
        if dest.is_file():  # the F16 file it came from may be gone (it is 15 GB at 8B)
            return dest
    if not base.is_file():
        say(f"writing {base.name} (random weights, {shape.name} shape) ...")
        started = time.monotonic()
        write_shape(shape, base, tokenizer=tokenizer, dtype="F32" if quant == "F32" else "F16")
        say(f"wrote {base} ({base.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - started:.0f} s")
    if dest is None:
        return base
    say(f"quantizing {base.name} to {quant} with {quantizer.path} ...")
    quantize(base, dest, quant, quantizer.path, log=say)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--quant", default=",".join(DEFAULT_QUANTS), help=f"comma-separated llama-quantize types, from {', '.join(QUANTS)} (default %(default)s)")
    parser.add_argument("--layers", type=int, default=None, help="decoder blocks, fewer than the real model's for a quick file (the name says so)")
    parser.add_argument("--plain-rope", action="store_true", help="no rope_freqs tensor (Llama 3's RoPE scaling): plain RoPE at the same base")
    opts = parser.parse_args(argv)
    try:
        shapes = [select(s, opts.layers, opts.plain_rope) for s in parse_list(opts.shape, SHAPES, "shape")]
        quants = parse_list(opts.quant, QUANTS, "quantization")
    except ValueError as exc:
        parser.error(str(exc))
    for shape in shapes:
        for quant in quants:
            print(ensure(shape, quant))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
