"""GGUF beyond llama: each architecture, in several quantization types, loads from GGUF and
generates the same greedy tokens as the equivalent mlx-lm folder; its chat template renders a
tools turn; a tensor type Kiln cannot read fails the load with the tensor's and type's name."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from kiln.worker.loading.gguf import UnsupportedModelError
from kiln.worker.loading.loader import load_model

from .tiny_gguf import CONFIGS, greedy, write_pair

# (case, quantization): every architecture, every type llama.cpp users download, K-quants twice.
CASES = [
    ("llama", "Q4_0"),
    ("mistral", "Q8_0"),
    ("qwen2", "Q4_1"),
    ("qwen3", "Q8_0"),
    ("qwen3", "K"),
    ("qwen3moe", "Q8_0"),
    ("phi3", "F16"),
    ("gemma2", "Q4_0"),
    ("gemma3", "K"),
    ("gemma3", "F32"),
]


@pytest.fixture(scope="module")
def tokenizer_md(gguf_path):
    import mlx.core as mx

    _, md = mx.load(str(gguf_path), return_metadata=True)
    return md


@pytest.mark.parametrize(("case", "quant"), CASES, ids=[f"{c}-{q}" for c, q in CASES])
def test_gguf_matches_mlx_folder(tmp_path, tokenizer_md, case, quant, caplog):
    gguf_file, folder = write_pair(case, quant, tokenizer_md, tmp_path)
    with caplog.at_level(logging.INFO, logger="kiln.worker.loading"):
        from_gguf = load_model(str(gguf_file))
    from_folder = load_model(str(folder))

    expected_arch = {"mistral": "llama"}.get(case, case)
    assert from_gguf.info.architecture == expected_arch
    assert from_gguf.context_window == CONFIGS[case].get("max_position_embeddings", 8192)
    ids_gguf, logits_gguf = greedy(from_gguf)
    ids_folder, logits_folder = greedy(from_folder)
    np.testing.assert_allclose(logits_gguf, logits_folder, rtol=1e-3, atol=1e-3)
    assert ids_gguf == ids_folder
    # The native CPU decode step takes only the llama-family blocks it checks itself against mlx.
    from kiln.worker.engine.native_decode import NativeDecoder

    if expected_arch not in ("llama", "qwen2", "qwen3"):
        assert NativeDecoder.build(from_gguf.model) is None
    if quant == "K":
        from kiln.worker.loading.device import keeps_gguf_blocks

        converted = {"Q4_K": "affine 4-bit g32", "Q5_K": "affine 5-bit g32", "Q6_K": "float16", "Q8_0": "affine 8-bit g32"}
        if expected_arch in ("llama", "qwen2", "qwen3") and keeps_gguf_blocks("auto"):
            # The CPU worker keeps every type of the file as its blocks, read in place by the native
            # kernels (and dequantized piecewise where mlx multiplies): the load says so.
            for type_name in converted:
                assert re.search(type_name + r" x \d+ -> GGUF blocks \(memory-mapped, native kernels\)", caplog.text)
            assert from_gguf.info.extra["conversions"] == dict.fromkeys(converted, "GGUF blocks")
        else:
            # Q4_K/Q5_K repack into mlx's affine layout, Q6_K has none (groups of 16): the load says so.
            assert re.search(r"Q4_K x \d+ -> affine 4-bit g32 \(scales and mins rounded to float16\)", caplog.text)
            assert re.search(r"Q6_K x \d+ -> float16 \(dequantized", caplog.text)
            assert from_gguf.info.extra["conversions"] == converted
        assert from_gguf.info.quantization == "gguf:Q4_K_M"
        # mlx's own quantized path (the GPU's; here mlx's CPU kernels) decodes the same tokens.
        native = load_model(str(gguf_file), weights="native")
        assert native.info.extra["conversions"] == converted
        assert greedy(native)[0] == ids_folder


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_chat_template_renders_tools_turn(tmp_path, tokenizer_md, case):
    gguf_file, _ = write_pair(case, "Q8_0", tokenizer_md, tmp_path)
    loaded = load_model(str(gguf_file))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C and sunny"},
    ]  # fmt: skip
    text = loaded.tokenizer.apply_chat_template(messages, tools=tools)
    assert '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18C and sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # The rendered special tokens are single ids, as the model was trained on them.
    ids = loaded.tokenizer.encode(text)
    assert ids.count(loaded.tokenizer.token_to_id("<|im_start|>")) == 5


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_unsupported_tensor_type_fails_with_its_name(tmp_path, tokenizer_md, case):
    bad, _ = write_pair(case, "Q8_0", tokenizer_md, tmp_path, unreadable="blk.0.attn_output.weight")
    with pytest.raises(UnsupportedModelError, match=r"'blk\.0\.attn_output\.weight' has GGML type Q8_1"):
        load_model(str(bad))


def test_unknown_tokenizer_model_is_refused_by_name(tmp_path, tokenizer_md):
    # llama.cpp's "t5" (Unigram) and "bert" (WordPiece) vocabularies are not rebuilt.
    gguf_file, _ = write_pair("gemma2", "Q8_0", tokenizer_md, tmp_path, tokenizer_model="t5")
    with pytest.raises(UnsupportedModelError, match="tokenizer model 't5' is not supported"):
        load_model(str(gguf_file))


def test_q4_k_model_decodes_through_the_native_cpu_kernel(tmp_path, tokenizer_md):
    """Every matrix Q4_K (256 wide): the CPU worker keeps the file's blocks for its native
    decode step, which checks itself against mlx, and generates the folder's tokens."""
    from gguf import GGMLQuantizationType as Q

    from kiln.worker.engine.native_decode import NativeDecoder
    from kiln.worker.loading.device import keeps_gguf_blocks, on_cpu

    cfg = dict(CONFIGS["llama"], hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    gguf_file, folder = write_pair("llama", "K", tokenizer_md, tmp_path, config=cfg, k_types=(Q.Q4_K,))
    loaded = load_model(str(gguf_file))
    assert loaded.info.extra["conversions"] == {"Q4_K": "GGUF blocks" if keeps_gguf_blocks("auto") else "affine 4-bit g32"}
    if on_cpu():
        assert NativeDecoder.build(loaded.model) is not None
    assert greedy(loaded)[0] == greedy(load_model(str(folder)))[0]


def test_rope_freqs_built_while_loading_runs_on_the_engine_thread():
    """A Llama 3.1/3.2 GGUF's ``rope_freqs`` RoPE is built on the loading thread and run on the
    engine's: it must not leave mlx work for a thread that has no stream of its own (every such
    file failed its first request with "There is no Stream(cpu, 0) in current thread")."""
    import threading

    import mlx.core as mx

    from kiln.worker.loading.gguf import FactorRoPE

    rope = FactorRoPE(8, 10000.0, mx.ones(4) * 2)
    out: dict[str, object] = {}

    def engine_thread() -> None:
        try:
            out["rotated"] = np.array(rope(mx.ones((1, 1, 2, 8))))
        except Exception as exc:  # noqa: BLE001 - the test reports what the thread raised
            out["error"] = repr(exc)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join(timeout=60)
    assert "error" not in out, out
    assert out["rotated"].shape == (1, 1, 2, 8)
