"""Model loading: tokenizer fidelity, chat template, GGUF and mlx-lm folder models, weights, BLAS."""

from __future__ import annotations

import os
import sys

import pytest

from kiln.worker.loading.chat_template import ChatTemplateError, render_chat_template
from kiln.worker.loading.errors import ModelNotFoundError
from kiln.worker.loading.loader import BUNDLED_MODEL_ID, load_model

TRICKY_TEXTS = [
    "Hello, world!",
    "  leading and   inner   spaces\t\ttabs\n\n\nnewlines  ",
    "naïve café — “quotes” … déjà vu",
    "emoji 🤖👍🏽 flags 🇫🇷 family 👨‍👩‍👧 and CJK 日本語の文章 한국어",
    'def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f"{f(3)=}")',
    "numbers 1234567890 and 3.14159, -42",
    "",
    " ",
    "\u200b zero width \u00a0 nbsp",
]

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY_TOKENS = 16


# --- tokenizer ------------------------------------------------------------


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_encode_decode_round_trip(gguf_tokenizer, text):
    ids = gguf_tokenizer.encode(text)
    assert gguf_tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_stream_decoder_matches_decode_token_by_token(gguf_tokenizer, text):
    ids = gguf_tokenizer.encode(text)
    decoder = gguf_tokenizer.stream_decoder()
    deltas = [decoder.feed(i) for i in ids]
    assert "".join(deltas) + decoder.flush() == text
    # No delta ever holds a broken character.
    assert all("\ufffd" not in d for d in deltas)


def test_stream_decoder_holds_partial_utf8(gguf_tokenizer):
    ids = gguf_tokenizer.encode("🤖")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    decoder = gguf_tokenizer.stream_decoder()
    assert [decoder.feed(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.feed(ids[-1]) == "🤖"


def test_special_tokens_in_text_map_to_single_ids(gguf_tokenizer):
    tok = gguf_tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") == 1
    assert ids[-1] == tok.token_to_id("<|im_end|>") == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_split_one_by_one(gguf_tokenizer):
    # SmolLM's ("smollm" pre-tokenizer) splits every digit; a GPT-2 split would merge them.
    tokens = [gguf_tokenizer.id_to_token(i) for i in gguf_tokenizer.encode("Hello, world! 2024")]
    assert tokens == ["Hello", ",", "Ġworld", "!", "Ġ", "2", "0", "2", "4"]


def test_tokenizer_facts(gguf_tokenizer):
    tok = gguf_tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert {0, 2} <= tok.eos_token_ids  # <|endoftext|> and <|im_end|>
    assert tok.hf_tokenizer.get_vocab_size() == 49152


def test_chat_template_renders_chatml(gguf_tokenizer):
    text = gguf_tokenizer.apply_chat_template(PROMPT)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = gguf_tokenizer.apply_chat_template(PROMPT, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n")


def test_template_environment_matches_hf():
    source = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m.content | tojson }};{% if loop.index == 3 %}{% break %}{% endif %}\n"
        "{% endfor %}"
        "{% if tools %}{{ tools | tojson(indent=1) }}{% endif %}"
        "{{ strftime_now('%Y') | length }}{{ flag }}"
    )
    messages = [{"role": "user", "content": "é"}, {"role": "skip", "content": "x"},
                {"role": "user", "content": "b"}, {"role": "user", "content": "never"}]  # fmt: skip
    out = render_chat_template(source, messages, tools=[{"a": 1}], flag="!")
    # trim_blocks eats the newline after each block tag; tojson keeps non-ASCII.
    assert out == '"é";"b";[\n {\n  "a": 1\n }\n]4!'
    with pytest.raises(ChatTemplateError, match="nope"):
        render_chat_template("{{ raise_exception('nope') }}", [])
    # trim_blocks/lstrip_blocks as in transformers
    assert render_chat_template("  {% if true %}\nx{% endif %}\n", []) == "x"
    # {% generation %} (training-mask marker) renders its body
    assert render_chat_template("{% generation %}g{% endgeneration %}", []) == "g"


# --- models ---------------------------------------------------------------


def _greedy(loaded, n: int = GREEDY_TOKENS) -> str:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    tok = loaded.tokenizer
    prompt = mx.array(tok.encode(tok.apply_chat_template(PROMPT)))
    ids: list[int] = []
    steps = generate_step(prompt, loaded.model, max_tokens=n, sampler=make_sampler(0.0))
    for token, _ in steps:
        if int(token) in tok.eos_token_ids:
            break
        ids.append(int(token))
    return tok.decode(ids)


@pytest.fixture(scope="module")
def gguf_answer(gguf_model) -> str:
    return _greedy(gguf_model)


def test_bundled_gguf_loads_and_answers(gguf_model, gguf_answer):
    assert gguf_model.model_id == BUNDLED_MODEL_ID
    assert gguf_model.aliases == [BUNDLED_MODEL_ID]
    assert gguf_model.context_window == 8192
    assert gguf_model.source_path.name.endswith(".gguf")
    assert "Paris" in gguf_answer


def test_cpu_auto_keeps_the_files_blocks_or_float32(gguf_model):
    """On the CPU, `auto` keeps the bundled file's Q4_1 and Q8_0 matrices as the file's blocks where
    the native kernels are built (no float copy of them), else dequantizes them to float32; never
    mlx's quantized layers, whose CPU products are slow."""
    import mlx.core as mx
    import mlx.nn as nn

    from kiln.worker.loading.device import keeps_gguf_blocks
    from kiln.worker.loading.ggml_blocks import GGMLEmbedding, GGMLLinear

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("auto keeps quantized weights off the CPU")
    assert gguf_model.weights == "float32"
    kinds = {type(m) for _, m in gguf_model.model.named_modules()}
    assert not kinds & {nn.QuantizedLinear, nn.QuantizedEmbedding}
    if keeps_gguf_blocks("auto"):
        assert {GGMLLinear, GGMLEmbedding} <= kinds
        assert nn.Linear not in kinds and nn.Embedding not in kinds
    else:
        assert gguf_model.model.model.embed_tokens.weight.dtype == mx.float32


def test_folder_matches_gguf(mlx_folder, gguf_model, gguf_answer):
    folder = load_model(str(mlx_folder))
    assert folder.model_id == mlx_folder.name.lower()
    assert folder.context_window == 8192
    assert folder.tokenizer.eos_token_ids == gguf_model.tokenizer.eos_token_ids
    assert folder.tokenizer.apply_chat_template(PROMPT) == gguf_model.tokenizer.apply_chat_template(PROMPT)
    assert folder.weights == gguf_model.weights
    assert _greedy(folder) == gguf_answer


def test_unknown_paths_are_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="expected a .gguf file"):
        load_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match="weights must be one of"):
        load_model(None, weights="int3")


def test_non_llama_gguf_is_refused(tmp_path):
    import mlx.core as mx

    from kiln.worker.loading.gguf import UnsupportedModelError, load_gguf

    path = tmp_path / "tiny.gguf"
    mx.save_gguf(str(path), {"x": mx.zeros((2,))}, {"general.architecture": "mamba"})
    with pytest.raises(UnsupportedModelError, match="'mamba' is not supported"):
        load_gguf(path)


# --- OpenBLAS preload --------------------------------------------------------


def test_preload_env_keeps_user_settings():
    from kiln.worker.loading import blas

    env = blas.preload_env("/x/libopenblas.so.0", {"LD_PRELOAD": "/y/libfoo.so", "OPENBLAS_NUM_THREADS": "1"}, "/shim")
    assert env["LD_PRELOAD"] == "/x/libopenblas.so.0 /y/libfoo.so"
    assert env["OPENBLAS_NUM_THREADS"] == "1"
    assert env["LD_LIBRARY_PATH"] == "/shim"
    assert blas.preloaded_openblas(env)
    assert not blas.should_reexec({blas.DISABLE_ENV: "1"})
    assert not blas.should_reexec(env)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux-only")
def test_reexec_puts_a_working_openblas_under_mlx(tmp_path):
    """Re-execute a script through reexec_with_openblas and time a matmul there."""
    import subprocess

    from kiln.worker.loading import blas

    if blas.find_openblas() is None:
        pytest.skip("no usable OpenBLAS on this machine")
    script = tmp_path / "probe.py"
    script.write_text(
        "import os, sys, time\n"
        "from kiln.worker.loading.blas import reexec_with_openblas\n"
        "reexec_with_openblas()\n"
        "import mlx.core as mx\n"
        "a = mx.random.normal((576, 576)); mx.eval(a @ a)\n"
        "t = time.process_time()\n"
        "for _ in range(20): mx.eval(a @ a)\n"
        "gflops = 20 * 2 * 576**3 / (time.process_time() - t) / 1e9\n"
        "print(os.environ.get('LD_PRELOAD', ''), os.environ['OPENBLAS_NUM_THREADS'], round(gflops, 1))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.DISABLE_ENV, "KILN_BLAS_REEXEC")}
    # One thread, timed in CPU seconds: other load on the machine does not skew it.
    env["OPENBLAS_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    preload, threads, gflops = out.stdout.split()
    assert "openblas" in preload
    assert threads == "1"  # the user's setting is kept
    # The reference BLAS manages ~6 GFLOP per CPU second; one OpenBLAS thread ~60.
    assert float(gflops) > 20


def test_sentencepiece_style_folder_streams_whole_characters(tmp_path):
    """A non-byte-level vocabulary (Llama-2/Mistral style: ▁ spaces, <0xNN> byte fallback)."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    from kiln.worker.loading.tokenizer import Tokenizer

    pieces = ["<unk>", "<s>", "</s>", "▁hello", "▁world", "▁", "<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]
    vocab = {p: i for i, p in enumerate(pieces)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{{ messages[0]['content'] }}"
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.eos_token_ids == {2} and tok.bos_token_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x"

    ids = [3, 4, 5, 6, 7, 8, 9, 4]  # "hello world 🤖 world"
    assert tok.decode(ids) == "hello world 🤖 world"
    decoder = tok.stream_decoder()
    deltas = [decoder.feed(i) for i in ids]
    assert deltas[3:6] == ["", "", ""]  # waits for the last byte of the emoji
    assert "".join(deltas) + decoder.flush() == "hello world 🤖 world"
