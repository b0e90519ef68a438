"""Where a CPU worker's time goes: `python -m bench.cpu_kernels` (mlx on the CPU only).

Kiln's CPU choices (float32 weights, OpenBLAS preloaded, the weight layout measured at start-up)
rest on a few kernel timings that differ from machine to machine. This prints them for the
bundled model on this machine:

- a decode step (1 and 8 rows) with the stored and the transposed float32 layout, and the native
  step on the packed weights (what the worker runs by default);
- the model's 210 layer matmuls at 1 row, as float32 (both layouts), bfloat16, float16 and
  8-/4-bit quantized through mlx, and through the native kernel; the tied output head;
- a prefill chunk of 512 tokens and the per-element cost of `exp`, with mlx's exp and with the
  polynomial one the engine installs on the CPU (worker/engine/cpu_exp.py: softmax and SiLU
  are exp-bound there).

Medians of a few repetitions; run it on a quiet machine.
"""

from __future__ import annotations

from kiln.worker.loading.blas import reexec_with_openblas

reexec_with_openblas()  # before mlx is imported, as the worker does

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from kiln.worker.engine import cpu_exp  # noqa: E402
from kiln.worker.engine.layout import input_major_while  # noqa: E402
from kiln.worker.engine.native_decode import NativeDecoder  # noqa: E402
from kiln.worker.loading.packed import PackedLinear  # noqa: E402
from kiln.worker.loading.loader import load_model  # noqa: E402


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of ``fn`` evaluated ``reps`` times after one warm-up."""
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def decode_step_ms(model: nn.Module, rows: int, reps: int) -> float:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1 + i % 100 for i in range(64)]] * rows), cache=cache))
    token = mx.array([[5]] * rows)
    return timed(lambda: model(token, cache=cache), reps)


def native_step_ms(model: nn.Module, decoder: NativeDecoder, rows: int, reps: int) -> float:
    cache = [BatchKVCache([0] * rows) for _ in model.model.layers]
    mx.eval(model(mx.array([[1 + i % 100 for i in range(64)]] * rows), cache=cache))
    token = mx.array([[5]] * rows)
    return timed(lambda: mx.array(decoder(token, cache)), reps)


def native_matmuls_ms(model: nn.Module, rows: int, reps: int) -> float:
    packed = [m._packed for _, m in model.named_modules() if type(m) is PackedLinear]
    x = {p.q.shape[1] * 8 // p.bits: np.ones((rows, p.q.shape[1] * 8 // p.bits), np.float32) for p in packed}
    return timed(lambda: [p.apply(x[p.q.shape[1] * 8 // p.bits]) for p in packed] and mx.array(0), reps)


def prefill(model: nn.Module, tokens: int) -> list:
    """The KV of a fresh prompt, without the logits (as the engine prefills)."""
    cache = make_prompt_cache(model)
    model(mx.array([[1 + i % 1000 for i in range(tokens)]]), cache=cache)
    return [c.state for c in cache]


def matmul_rows(model: nn.Module, reps: int) -> list[tuple[str, float]]:
    weights = [m.weight for _, m in model.named_modules() if type(m) is nn.Linear]
    x = {w.shape[1]: mx.ones((1, w.shape[1])) for w in weights}
    out = [("float32, stored (out, in)", timed(lambda: [x[w.shape[1]] @ w.T for w in weights], reps))]
    transposed = [mx.contiguous(w.T) for w in weights]
    mx.eval(transposed)
    out.append(("float32, transposed (in, out)", timed(lambda: [x[w.shape[0]] @ w for w in transposed], reps)))
    for dtype in (mx.bfloat16, mx.float16):
        cast = [w.astype(dtype) for w in weights]
        xs = {k: v.astype(dtype) for k, v in x.items()}
        mx.eval(cast)
        out.append((str(dtype).split(".")[-1], timed(lambda: [xs[w.shape[1]] @ w.T for w in cast], reps)))
    for bits in (8, 4):
        quant = [mx.quantize(w, group_size=64, bits=bits) for w in weights]
        mx.eval(quant)
        out.append((f"{bits}-bit quantized", timed(lambda: [mx.quantized_matmul(x[w.shape[1]], q, s, b, transpose=True, group_size=64, bits=bits) for w, (q, s, b) in zip(weights, quant)], reps)))
    embed = model.model.embed_tokens.weight
    xe = mx.ones((1, embed.shape[1]))
    out.append((f"output head {tuple(embed.shape)}", timed(lambda: xe @ embed.T, reps)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    opts = p.parse_args()
    model = load_model(None, weights="float32").model  # float32 alone, stored layout
    print(f"device {mx.default_device()}; medians of {opts.reps}\n")
    print("decode step (ms)            stored  transposed")
    stock = [decode_step_ms(model, rows, opts.reps) for rows in (1, 8)]
    with input_major_while(model):
        swapped = [decode_step_ms(model, rows, opts.reps) for rows in (1, 8)]
    for rows, a, b in zip((1, 8), stock, swapped):
        print(f"  {rows} row(s)                  {a:6.1f}  {b:10.1f}")
    print("\n210 layer matmuls, 1 row (ms)")
    for name, ms in matmul_rows(model, opts.reps):
        print(f"  {name:32s} {ms:7.1f}")
    packed = load_model(None).model  # what the worker runs: float32 for prefill, packed for decode
    decoder = NativeDecoder.build(packed)
    if decoder is None:
        print("\nnative kernels unavailable here (no C compiler?)")
    else:
        print("\nnative, packed 4-bit weights (ms)   1 row  8 rows")
        print(f"  decode step                      {native_step_ms(packed, decoder, 1, opts.reps):6.1f} {native_step_ms(packed, decoder, 8, opts.reps):7.1f}")
        print(f"  210 layer matmuls                {native_matmuls_ms(packed, 1, opts.reps):6.1f} {native_matmuls_ms(packed, 8, opts.reps):7.1f}")
    s = mx.random.normal((9, 512, 512))
    mx.eval(s)
    reps = max(2, opts.reps // 2)
    stock_ms = timed(lambda: prefill(model, 512), reps)
    exp_ms, mul_ms = timed(lambda: mx.exp(s), opts.reps), timed(lambda: s * s, opts.reps)
    if not cpu_exp.install(model):  # what the engine does on the CPU (cpu_exp.py)
        print("\ncpu_exp did not install here")
        return
    ours_ms = timed(lambda: prefill(model, 512), reps)
    poly_ms = timed(lambda: cpu_exp.exp(s), opts.reps)
    print("\n                                     mlx's exp  cpu_exp")
    print(f"prefill, 512 tokens, KV only (ms)  {stock_ms:9.0f} {ours_ms:8.0f}")
    print(f"exp (ns per element)               {1e6 * exp_ms / s.size:9.2f} {1e6 * poly_ms / s.size:8.2f}   (a multiply: {1e6 * mul_ms / s.size:.2f})")


if __name__ == "__main__":
    main()
