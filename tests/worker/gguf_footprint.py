"""Load time and memory of the tiny GGUF test models, per architecture and quantization.

    .venv/bin/python -m tests.worker.gguf_footprint [--weights auto|native] [--repeat 3]

Writes each tiny model (tiny_gguf.write_pair, the bundled vocabulary) to a temporary folder, then
loads it in a fresh process per case and prints a Markdown table: file size, the bytes of the
model's parameters as loaded (with `--weights native`, the stored quantized layout, and with the
chosen `--weights`), the resident set before and after the first `load_model`, and the load
times: the first (which imports mlx-lm's model module, tokenizers, ...) and a second one in the
same process (median of the repeats). Not a test: timings on a shared machine
are noise, so nothing here is asserted; the table goes into docs/models.md and reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = [
    ("llama", "Q4_0"), ("mistral", "Q8_0"), ("qwen2", "Q4_1"), ("qwen3", "Q8_0"), ("qwen3", "K"),
    ("qwen3moe", "Q8_0"), ("phi3", "F16"), ("gemma2", "Q4_0"), ("gemma3", "K"), ("gemma3", "F32"),
]  # fmt: skip

_CHILD = r"""
import json, sys, time
def rss_mb():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmRSS:")) / 1024
from mlx.utils import tree_flatten
from kiln.worker.loading.loader import load_model
def load(weights):
    started = time.perf_counter()
    loaded = load_model(sys.argv[1], weights=weights)
    return loaded, time.perf_counter() - started, sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
before = rss_mb()
first, cold, params = load(sys.argv[2])  # imports mlx-lm's model module, tokenizers, jinja2, ...
after = rss_mb()
del first
_, warm, _ = load(sys.argv[2])
_, _, native = load("native")
print(json.dumps({"cold": cold, "warm": warm, "before": before, "after": after, "params": params, "native": native}))
"""


def _measure(path: Path, weights: str, repeat: int) -> dict[str, float]:
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(path), weights], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import mlx.core as mx

    from kiln.worker.loading.loader import bundled_model_path

    from .tiny_gguf import write_pair

    _, md = mx.load(str(bundled_model_path()), return_metadata=True)
    print(f"weights={args.weights}, median of {args.repeat} fresh processes each")
    print(f"| model | file | parameters: native / {args.weights} | RSS before -> after first load | first load (with imports) / second |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for case, quant in CASES:
            folder = Path(tmp) / f"{case}-{quant}"
            folder.mkdir()
            path, _ = write_pair(case, quant, md, folder)
            _row(f"tiny {case} {quant}", path, _measure(path, args.weights, args.repeat))
        bundled = bundled_model_path()
        _row("bundled SmolLM2-135M Q4_1", bundled, _measure(bundled, args.weights, args.repeat))


def _row(name: str, path: Path, m: dict[str, float]) -> None:
    print(f"| {name} | {path.stat().st_size / 2**20:.1f} MiB | {m['native'] / 2**20:.1f} / {m['params'] / 2**20:.1f} MiB "
          f"| {m['before']:.0f} -> {m['after']:.0f} MB | {m['cold']:.2f} / {m['warm']:.2f} s |")  # fmt: skip


if __name__ == "__main__":
    main()
