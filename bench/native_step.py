"""The CPU decode step, one way against another: `python -m bench.native_step`.

For the bundled model (SmolLM2-135M, Q4_1) it times, interleaved in one run so that a busy
machine slows every contender alike:

- ``mlx``: a decode step through mlx's graph (float32 weights, OpenBLAS), what a CPU worker
  runs for a model the native pass does not take;
- ``native f32``: the native forward pass (worker/native/decode.c) with float32 activations;
- ``native int8``: the same with 8-bit activations and integer dot products (the default where
  the CPU has them);

at 1 and 8 rows, with 1 thread and with every core, and a prompt of 78 tokens (the bench's
single-stream prompt) prefilled by mlx and by the native pass. Wall-clock medians and minima;
the minimum is the better estimate on a shared machine (contention only adds time).
``--cpu`` reports the process's CPU time instead (every thread's, mlx's own included): on a
machine shared with other busy processes that is the work each contender does, which wall
clock no longer shows (use it with OMP_NUM_THREADS=1: a second thread's spinning counts too).
"""

from __future__ import annotations

from kiln.worker.loading.blas import reexec_with_openblas

reexec_with_openblas()  # before mlx is imported, as the worker does

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from kiln.worker.engine.native_decode import NativeDecoder, _layer  # noqa: E402
from kiln.worker.loading.loader import load_model  # noqa: E402
from kiln.worker.native.threads import TeamSize  # noqa: E402

PROMPT = 64  # cached positions before the timed steps


def prefilled(model, rows: int) -> list[BatchKVCache]:
    cache = [BatchKVCache([0] * rows) for _ in model.model.layers]
    model(mx.array([[1 + i % 100 for i in range(PROMPT)]] * rows), cache=cache)
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def interleaved(contenders: dict[str, Callable[[], object]], reps: int, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Milliseconds per call of each contender, one call of each in turn, after one warm-up."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(reps + 1):
        for name, fn in contenders.items():
            start = clock()
            mx.eval(fn())
            if rep:
                times[name].append(1e3 * (clock() - start))
    return times


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.native_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--cpu", action="store_true", help="process CPU time instead of wall clock")
    opts = p.parse_args()
    clock = time.process_time if opts.cpu else time.perf_counter
    loaded = load_model(None)
    model = loaded.model
    inner = model.model
    decoder = NativeDecoder.build(model)
    if decoder is None:
        raise SystemExit("the native pass does not run here (no C compiler, or it disagreed with mlx)")
    kernels = decoder._kernels
    kernels.claim_team()  # this thread computes on the team, as the worker's engine thread does
    layers = [_layer(block, inner.norm.eps) for block in inner.layers]
    head = inner.embed_tokens._packed
    passes = {"native f32": NativeDecoder(model, layers, head, int8=False)}
    if kernels.int8:
        passes["native int8"] = NativeDecoder(model, layers, head, int8=True)
    cores = int(os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"build {kernels.variant}; {cores} core(s); load average {os.getloadavg()[0]:.1f}; {'CPU' if opts.cpu else 'wall'} ms, median / min of {opts.reps}\n", flush=True)
    print(f"{'decode step':14s}{'rows':>5s}{'threads':>8s}  " + "  ".join(f"{name:>16s}" for name in ["mlx", *passes]))
    for threads in sorted({1, cores}):
        kernels.set_threads(threads)
        kernels.team = TeamSize(threads, kernels.set_threads, fixed=True)  # no switching while timed
        for rows in (1, 8):
            token = mx.array([[5]] * rows)
            caches = {name: prefilled(model, rows) for name in ["mlx", *passes]}
            contenders: dict[str, Callable[[], object]] = {"mlx": lambda c=caches["mlx"]: model(token, cache=c)}
            for name, native in passes.items():
                contenders[name] = lambda n=native, c=caches[name]: mx.array(n(token, c))
            times = interleaved(contenders, opts.reps, clock)
            cells = [f"{statistics.median(v):7.1f} / {min(v):6.1f}" for v in times.values()]
            print(f"{'':14s}{rows:5d}{threads:8d}  " + "  ".join(f"{c:>16s}" for c in cells), flush=True)
    kernels.set_threads(cores)
    kernels.team = TeamSize(cores, kernels.set_threads, fixed=True)
    tokens = [[1 + (7 * i) % 1000 for i in range(78)]]

    def mlx_prefill() -> object:
        cache = make_prompt_cache(model)
        model(mx.array(tokens), cache=cache)
        return [c.state for c in cache]

    contenders = {"mlx": mlx_prefill}
    for name, native in passes.items():
        contenders[name] = lambda n=native: n.prefill(np.array(tokens), [BatchKVCache([0]) for _ in inner.layers]) or mx.array(0)
    times = interleaved(contenders, max(3, opts.reps // 4), clock)
    print(f"\n{'prefill 78':14s}{1:5d}{cores:8d}  " + "  ".join(f"{f'{statistics.median(v):7.1f} / {min(v):6.1f}':>16s}" for v in times.values()))


if __name__ == "__main__":
    main()
