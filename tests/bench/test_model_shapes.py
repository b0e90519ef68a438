"""`./dev bench --model-shape`: the random-weight GGUFs of real models' shapes, the options that
pick them, and the cache that keeps them (no timings: bench/ measures, tests check)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench import __main__ as bench_main
from bench import model_shapes as ms
from bench.convert import bundled_gguf
from kiln.worker.loading.gguf_header import read_header

# The real 1B shape with small dimensions: every kind of tensor and key, written in well under a second.
SMALL = dataclasses.replace(ms.SHAPES["llama-3.2-1b"], name="small-llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96)
SMALL_QWEN = dataclasses.replace(ms.SHAPES["qwen2.5-7b"], name="small-qwen", hidden=64, layers=2, heads=4, kv_heads=1, ffn=160)


_TYPES = {0: "F32", 1: "F16"}


def _tensors(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name: (type, numpy shape: (out, in) for a linear layer)."""
    return {t.name: (_TYPES.get(t.type_id, str(t.type_id)), t.shape) for t in read_header(path).tensors}


def test_written_llama_file_states_the_shape_and_carries_the_bundled_tokenizer(tmp_path):
    path = ms.write_shape(SMALL, tmp_path / "small.gguf", tokenizer=bundled_gguf())
    md, bundled = read_header(path).metadata, read_header(bundled_gguf()).metadata
    vocab = len(bundled["tokenizer.ggml.tokens"])
    assert md["general.architecture"] == "llama"
    assert md["llama.embedding_length"] == 64
    assert md["llama.block_count"] == 2
    assert md["llama.attention.head_count"] == 4
    assert md["llama.attention.head_count_kv"] == 2
    assert md["llama.feed_forward_length"] == 96
    assert md["llama.rope.freq_base"] == 500000.0
    assert md["llama.rope.dimension_count"] == 16
    assert md["llama.context_length"] == 131072
    assert abs(md["llama.attention.layer_norm_rms_epsilon"] - 1e-5) < 1e-9
    assert md["llama.vocab_size"] == vocab
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.merges", "tokenizer.ggml.tokens"):
        assert md[key] == bundled[key]
    assert np.array_equal(md["tokenizer.ggml.token_type"], bundled["tokenizer.ggml.token_type"])
    tensors = _tensors(path)
    assert tensors["token_embd.weight"] == ("F16", (vocab, 64))
    assert tensors["blk.1.attn_q.weight"] == ("F16", (64, 64))
    assert tensors["blk.1.attn_k.weight"] == ("F16", (32, 64))
    assert tensors["blk.0.ffn_down.weight"] == ("F16", (64, 96))
    assert tensors["blk.0.attn_norm.weight"] == ("F32", (64,))
    assert "output.weight" not in tensors  # Llama 3.2 ties its output head to the embeddings
    assert "blk.0.attn_q.bias" not in tensors
    # Llama 3's frequency scaling, as llama.cpp's converter writes it: 1 for the fast rotations,
    # the factor (32) for the slow ones.
    info = next(t for t in read_header(path).tensors if t.name == "rope_freqs.weight")
    freqs = np.fromfile(path, np.float32, count=8, offset=info.offset)
    assert freqs.shape == (8,) and freqs[0] == 1.0 and freqs[-1] == 32.0 and np.all(np.diff(freqs) >= 0)
    assert not (tmp_path / "small.gguf.tmp").exists()


def test_written_qwen_file_has_biases_and_its_own_output_head(tmp_path):
    path = ms.write_shape(SMALL_QWEN, tmp_path / "q.gguf", tokenizer=bundled_gguf(), dtype="F32")
    md = read_header(path).metadata
    assert md["general.architecture"] == "qwen2"
    assert md["qwen2.attention.head_count_kv"] == 1
    assert abs(md["qwen2.attention.layer_norm_rms_epsilon"] - 1e-6) < 1e-12
    tensors = _tensors(path)
    assert tensors["output.weight"][0] == "F32"
    assert tensors["blk.0.attn_k.bias"] == ("F32", (16,))
    assert "rope_freqs.weight" not in tensors


def test_the_table_holds_each_named_model():
    one_b = ms.SHAPES["llama-3.2-1b"]
    assert (one_b.hidden, one_b.layers, one_b.heads, one_b.kv_heads, one_b.ffn, one_b.head_dim, one_b.tied_embeddings) == (2048, 16, 32, 8, 8192, 64, True)
    assert not ms.SHAPES["llama-3.1-8b"].tied_embeddings and ms.SHAPES["qwen2.5-7b"].qkv_bias
    assert set(ms.SHAPES) == {"llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b"}


def test_cache_names_change_with_everything_the_file_depends_on(tmp_path):
    tok = bundled_gguf()
    one_b = ms.SHAPES["llama-3.2-1b"]
    base = ms.shape_path(one_b, "F16", tokenizer=tok, root=tmp_path)
    assert base == ms.shape_path(one_b, "F16", tokenizer=tok, root=tmp_path)  # stable
    assert base.name.startswith("llama-3.2-1b-") and base.name.endswith("-F16.gguf")
    fewer = ms.shape_path(one_b.with_layers(2), "F16", tokenizer=tok, root=tmp_path)
    assert fewer.name.startswith("llama-3.2-1b-2l-") and fewer != base
    q4 = ms.shape_path(one_b, "Q4_K_M", tokenizer=tok, quantizer_key="0.3.36-aaaa", root=tmp_path)
    assert q4 != ms.shape_path(one_b, "Q4_K_M", tokenizer=tok, quantizer_key="0.3.36-bbbb", root=tmp_path)
    assert q4 != ms.shape_path(ms.SHAPES["llama-3.2-3b"], "Q4_K_M", tokenizer=tok, quantizer_key="0.3.36-aaaa", root=tmp_path)
    plain = ms.shape_path(one_b.with_plain_rope(), "F16", tokenizer=tok, root=tmp_path)
    assert plain.name.startswith("llama-3.2-1b-plainrope-") and plain != base
    with pytest.raises(ValueError):
        ms.shape_path(one_b, "Q8_0", tokenizer=tok, root=tmp_path)  # a quantized file names its quantizer


def test_plain_rope_file_has_no_rope_freqs(tmp_path):
    path = ms.write_shape(SMALL.with_plain_rope(), tmp_path / "plain.gguf", tokenizer=bundled_gguf())
    assert "rope_freqs.weight" not in _tensors(path)
    assert read_header(path).metadata["llama.rope.freq_base"] == 500000.0


def test_model_shape_options():
    opts = bench_main.parse_args(["--model-shape", "llama-3.2-1b,qwen2.5-7b", "--quant", "q4_k_m,Q8_0,Q4_K_M"])
    assert [s.name for s in opts.shapes] == ["llama-3.2-1b", "qwen2.5-7b"]
    assert opts.quants == ["Q4_K_M", "Q8_0"]
    assert opts.thread_counts == [1, 2]
    assert opts.peers == "kiln,llama_cpp"
    assert opts.workloads == "single,concurrent,long_prompt"
    opts = bench_main.parse_args(["--model-shape", "llama-3.2-1b", "--threads", "1", "--shape-layers", "2", "--plain-rope"])
    assert opts.thread_counts == [1] and opts.shapes[0].layers == 2 and opts.quants == ["Q4_K_M"]
    assert opts.shapes[0].rope_scaling is None and opts.shapes[0].name == "llama-3.2-1b-2l-plainrope"
    plain = bench_main.parse_args([])
    assert plain.shapes == [] and plain.thread_counts == [None] and "mlx_lm_f32" in plain.peers
    assert bench_main.parse_args(["--threads", "2"]).thread_counts == [2]


@pytest.mark.parametrize("argv", [["--model-shape", "llama-9b"], ["--model-shape", "llama-3.2-1b", "--quant", "Q3_X"], ["--threads", "0"], ["--model-shape", "llama-3.2-1b", "--shape-layers", "0"]])
def test_bad_model_shape_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench_main.parse_args(argv)
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("peer", ["kiln", "kiln_chat", "llama_cpp"])
def test_every_peer_serves_the_shape_file_under_one_id(peer, tmp_path, monkeypatch):
    from bench import llama_cpp, servers

    builds: list[str] = []  # the CPU level each llama-server was asked for
    monkeypatch.setattr(llama_cpp, "server_binary", lambda cpu="native": builds.append(cpu) or llama_cpp.Binary(tmp_path / "llama-server", "test", "on PATH"))
    monkeypatch.delenv("KILN_NATIVE_VARIANT", raising=False)
    model = servers.ModelFile(tmp_path / "llama-3.2-1b-x-Q4_K_M.gguf", "llama-3.2-1b-q4_k_m")
    spec = servers.spec_for(peer, threads=1, model=model)
    assert spec.model == "llama-3.2-1b-q4_k_m" and str(model.path) in spec.argv
    if peer.startswith("kiln"):
        argv = " ".join(spec.argv)
        assert "--model-id llama-3.2-1b-q4_k_m" in argv and "--speculative off" in argv and "--context-length 2048" in argv
    # --cpu avx2: Kiln on its avx2 build, llama-server built for AVX2 alone
    avx2 = servers.spec_for(peer, threads=1, model=model, cpu="avx2")
    if peer.startswith("kiln"):
        assert avx2.env["KILN_NATIVE_VARIANT"] == "avx2" and "KILN_NATIVE_VARIANT" not in spec.env
    else:
        assert builds == ["native", "avx2"]
    with pytest.raises(servers.PeerUnavailable):
        servers.spec_for("mlx_lm_q4", model=model)
