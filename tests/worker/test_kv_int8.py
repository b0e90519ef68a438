"""The 8-bit KV cache (``--kv-cache int8``, worker/engine/kv_int8.py): what it stores, that the
native pass keeps it only where that pass runs every step, and that a model served with it
answers as mlx's float32 pass does within the build check's margin."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache

from kiln.worker.engine import kv_int8

from .test_native_ggml import _gemm_model, tokenizer_md  # noqa: F401  (a fixture)


def test_positions_round_within_half_a_step_of_their_block():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 128)).astype(np.float32) * np.float32(3.0)
    x[0, 0, 0, :32] = 0.0  # a block of zeros keeps a zero scale
    x[1, 2, 4, 64:96] *= 1000  # an outlier block does not coarsen its neighbours
    stored = kv_int8.quantize(x)
    assert stored.dtype == np.uint8 and stored.shape == (2, 3, 5, kv_int8.position_bytes(kv_int8.INT8, 128)) == (2, 3, 5, 144)
    back = kv_int8.dequantize(stored, 128)
    step = np.abs(x.reshape(2, 3, 5, 4, 32)).max(-1, keepdims=True) / 127
    assert np.all(np.abs(back - x).reshape(2, 3, 5, 4, 32) <= step / 2 * (1 + 1e-6))
    assert np.all(back[0, 0, 0, :32] == 0)
    assert np.abs(back[1, 2, 4, :64] - x[1, 2, 4, :64]).max() < 0.05


def test_the_native_pass_stores_what_numpy_rounds_and_answers_within_the_check(tmp_path, tokenizer_md):  # noqa: F811
    """One prompt through the pass with each cache: the first layer's keys and values (which no
    8-bit attention has touched yet) are numpy's rounding of the float32 pass's, byte for byte;
    the cache takes 0.28 of the bytes; the next tokens' distributions agree within the build
    check's KV8 bound; and a chunk's attention (attention.c) over the 8-bit cache is the one-row
    attention's (decode.c) over it, up to float rounding."""
    from kiln.worker.engine.native_decode import KV8, NativeDecoder, log_softmax

    model = _gemm_model(tmp_path, tokenizer_md)
    vocab = model.model.embed_tokens.num_embeddings
    prompt = np.array([[(11 * j + 3) % vocab for j in range(40)]], dtype=np.int32)  # T >= 16: attention.c
    wide = NativeDecoder.build(model)
    narrow = NativeDecoder.build(model, kv="int8")
    assert wide is not None and narrow is not None and narrow.kv_int8 and not wide.kv_int8
    outs = {}
    caches = {}
    for name, decoder in (("float32", wide), ("int8", narrow)):
        cache = [BatchKVCache([0]) for _ in model.model.layers]
        logits = [decoder.forward(prompt, cache)[0, -1]]
        for t in (5, 9, 2, 7):  # single steps: decode.c's one-row attention
            logits.append(decoder(np.array([[t]], dtype=np.int32), cache)[0])
        outs[name], caches[name] = np.stack(logits), cache
    first_f32, first_i8 = caches["float32"][0], caches["int8"][0]
    n = first_f32._idx
    keys_f32 = np.asarray(first_f32.keys)[:, :, :n]
    keys_i8 = np.asarray(first_i8.keys)[:, :, :n]
    assert keys_i8.dtype == np.uint8
    assert np.array_equal(keys_i8[:, :, :40], kv_int8.quantize(keys_f32[:, :, :40]))
    assert np.array_equal(np.asarray(first_i8.values)[:, :, :40], kv_int8.quantize(np.asarray(first_f32.values)[:, :, :40]))
    assert first_i8.nbytes / first_f32.nbytes == pytest.approx(kv_int8.position_bytes(kv_int8.INT8, keys_f32.shape[-1]) / (4 * keys_f32.shape[-1]))
    assert KV8.agree(outs["int8"], outs["float32"])
    # 20 new tokens at once (attention.c's chunk) or ten at a time (decode.c's rows): the same up
    # to float rounding (which may flip an 8-bit activation's rounding here and there: not bits).
    more = np.array([[(7 * j + 1) % vocab for j in range(20)]], dtype=np.int32)
    chunked, rows = caches["int8"], [BatchKVCache([0]) for _ in model.model.layers]
    narrow.prefill(prompt, rows)
    for t in (5, 9, 2, 7):
        narrow.prefill(np.array([[t]], dtype=np.int32), rows)
    at_once = narrow.forward(more, chunked)[0]
    by_ten = np.concatenate([narrow.forward(more[:, i : i + 10], rows)[0] for i in (0, 10)])
    mine, theirs = log_softmax(at_once.astype(np.float64)), log_softmax(by_ten.astype(np.float64))
    assert (np.exp(theirs) * (theirs - mine)).sum(-1).max() < 1e-3


def test_served_with_the_8_bit_cache_through_the_scheduler(tmp_path, tokenizer_md, caplog):  # noqa: F811
    """The scheduler with --kv-cache int8 on a Q4_K_M-style file: a long prompt (chunked), a
    prefix-cache hit and greedy decoding with speculation on all run on the 8-bit cache, and each
    request's first token is mlx's float32 one, or within the check's margins of it."""
    from kiln.worker.engine.native_decode import INT8, KV8
    from kiln.worker.engine.scheduler import Scheduler
    from kiln.worker.engine.speculative import Speculation

    from .test_engine import Run

    model = _gemm_model(tmp_path, tokenizer_md)
    vocab = model.model.embed_tokens.num_embeddings
    system = [(7 * j + 5) % vocab for j in range(150)]
    prompts = [system + [(11 * j + 3) % vocab for j in range(20)], system + [(13 * j + 1) % vocab for j in range(25)], [(3 * j + 2) % vocab for j in range(9)] * 4]
    with caplog.at_level(logging.INFO, logger="kiln.worker.engine.native_decode"):
        s = Scheduler(model, cache_bytes=64 << 20, max_batch=4, prefill_chunk=64, speculation=Speculation("on", 4), kv_cache="int8")
        s.start()
        try:
            runs = [Run(p, temperature=0, max_tokens=8).submit(s) for p in prompts[:1]]
            runs[0].wait(timeout=300)
            runs += [Run(p, temperature=0, max_tokens=8).submit(s) for p in prompts[1:]]
            for r in runs:
                assert len(r.wait(timeout=300).tokens) == 8
            assert s._native is not None and s._native.kv_int8
            assert s._prefix is not None and s._prefix.hits >= 1
            cached = next(iter(s._prefix._lru.values()))
            assert cached[0].keys.dtype == mx.uint8
        finally:
            s.stop()
    assert "8-bit KV cache" in caplog.text
    for p, r in zip(prompts, runs, strict=True):
        logits = np.array(model(mx.array([p]))[0, -1])
        assert logits[r.tokens[0]] >= logits.max() - 2.5 * INT8.decided - KV8.decided


def test_a_model_the_pass_does_not_take_whole_keeps_float32(caplog):
    """The bundled model with `--weights float32` (float32 copies and packed ones, not the file's
    blocks: prompts go through mlx, which cannot read 8 bits) keeps the float32 cache and says why."""
    from kiln.worker.engine.native_decode import NativeDecoder
    from kiln.worker.loading.loader import load_model

    model = load_model(None, weights="float32").model
    with caplog.at_level(logging.WARNING, logger="kiln.worker.engine.native_decode"):
        decoder = NativeDecoder.build(model, kv="int8")
    if decoder is None:
        pytest.skip("no native pass on this machine")
    assert not decoder.kv_int8
    assert "--kv-cache int8 needs the native pass to run every step" in caplog.text


def test_more_rows_than_one_native_call_takes_are_refused():
    """By the engine, and by kiln-worker before it loads anything: a usage error, no traceback."""
    import subprocess
    import sys

    from kiln.worker.engine.native_decode import PREFILL_TOKENS
    from kiln.worker.engine.scheduler import Scheduler
    from tests.support import process_env

    with pytest.raises(ValueError, match="--kv-cache int8 decodes at most"):
        Scheduler(object(), max_batch=PREFILL_TOKENS + 1, kv_cache="int8")  # type: ignore[arg-type]
    argv = [sys.executable, "-m", "kiln.worker", "--kv-cache", "int8", "--max-batch", str(PREFILL_TOKENS + 1), "--gateway", "tcp://127.0.0.1:9"]
    done = subprocess.run(argv, env=process_env({}), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--kv-cache int8 decodes at most 512 requests together" in done.stderr and "Traceback" not in done.stderr


def test_a_config_model_table_sets_the_cache(tmp_path):
    """kiln.toml's kv_cache key reaches that model's workers (kiln serve --config, kiln-worker
    --config)."""
    from kiln.protocol.model_config import load_config

    path = tmp_path / "kiln.toml"
    path.write_text('[[models]]\nid = "a"\nsource = "a.gguf"\nkv_cache = "int8"\n[[models]]\nid = "b"\nsource = "b.gguf"\n')
    config = load_config(path)
    assert config.model("a").worker_settings()["kv_cache"] == "int8"
    assert "kv_cache" not in config.model("b").worker_settings()  # the worker's default


def test_the_memory_report_counts_the_8_bit_layout():
    """/v1/models' kv figures follow the cache kept: 36 bytes per 32 values where it is 8-bit."""
    from kiln.worker.loading.loader import load_model
    from kiln.worker.memory_report import memory_report

    model = load_model(None).model
    wide, narrow = memory_report(model, 1024), memory_report(model, 1024, kv_int8=True)
    args = model.args
    head_dim = args.hidden_size // args.num_attention_heads
    assert narrow["kv_bytes_per_token"] == 2 * args.num_hidden_layers * args.num_key_value_heads * (head_dim + 4 * head_dim // 32)
    assert narrow["kv_cache_bytes"] == 1024 * narrow["kv_bytes_per_token"]
    assert narrow["kv_bytes_per_token"] / wide["kv_bytes_per_token"] == 36 / 128
