"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Phi-3,
Gemma) tokenize exactly as llama.cpp does, which for text between control tokens is the
original SentencePiece model itself: checked against real models trained here with the
`sentencepiece` package, written into GGUFs of the llama and gemma architectures the way
llama.cpp's converter writes them."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.worker.loading.loader import load_model
from kiln.worker.loading.gguf_vocab import UnsupportedTokenizerError, build_hf_tokenizer

from .tiny_gguf import greedy, write_pair
from .tiny_spm import STYLES, gguf_metadata, reference_ids, train, varied_texts

# (style of vocabulary, GGUF architecture): Mistral's on llama, Gemma's on both Gemmas.
CASES = [("mistral", "llama"), ("gemma", "gemma2"), ("gemma", "gemma3")]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18C and sunny"},
]  # fmt: skip


@pytest.fixture(scope="module")
def vocabularies():
    """style -> (the trained SentencePiece model, its GGUF tokenizer metadata)."""
    out = {}
    for style in STYLES:
        sp = train(style)
        out[style] = (sp, gguf_metadata(sp, style))
    return out


@pytest.fixture(scope="module")
def pairs(vocabularies, tmp_path_factory):
    """(style, arch) -> (GGUF path, mlx-lm folder path) of a tiny random model with that vocabulary."""
    out = {}
    for style, arch in CASES:
        md = vocabularies[style][1]
        out[style, arch] = write_pair(arch, "Q8_0", md, tmp_path_factory.mktemp(f"{style}-{arch}"), chat_template=STYLES[style].template)
    return out


@pytest.fixture(scope="module")
def tokenizers(pairs):
    """style -> the Tokenizer a loaded GGUF of that vocabulary has."""
    return {style: load_model(str(pairs[style, arch][0])).tokenizer for style, arch in CASES if arch != "gemma3"}


@pytest.mark.parametrize("style", list(STYLES))
def test_tokenizes_as_sentencepiece(vocabularies, tokenizers, style):
    sp, _ = vocabularies[style]
    tok = tokenizers[style]
    texts = varied_texts(style)
    wrong = [(t, tok.encode(t), reference_ids(sp, style, t)) for t in texts if tok.encode(t) != reference_ids(sp, style, t)]
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ, e.g. {wrong[:3]}"
    # Byte fallback happened (emoji are not pieces), and runs of spaces became whitespace pieces.
    assert tok.encode("😀")[-4:] == [sp.piece_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    assert any(set(sp.id_to_piece(i)) == {"\u2581"} and len(sp.id_to_piece(i)) > 1 for i in tok.encode("a      b"))
    if style == "gemma":  # user-defined pieces are cut from the raw text, as llama.cpp cuts them
        eight = sp.piece_to_id("\u2581" * 8)
        assert tok.encode("x" + " " * 8 + "y") == [*sp.encode("x"), eight, *sp.encode("y")]
        assert tok.encode("\u2581" + " " * 8) == [*sp.encode("\u2581"), eight]


@pytest.mark.parametrize("style", list(STYLES))
def test_decodes_back_to_the_text(vocabularies, tokenizers, style):
    sp, _ = vocabularies[style]
    tok = tokenizers[style]
    cut = [*STYLES[style].control, "<s>", "\u2581"]  # a "▁" in text decodes as a space, as in SentencePiece
    texts = [t for t in varied_texts(style) if not any(c in t for c in cut)]
    assert len(texts) > 500
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text == sp.decode(ids)
    # Streaming, one id at a time, gives the same text (byte-fallback characters whole).
    for text in texts[:200]:
        stream = tok.stream_decoder()
        pieces = [stream.feed(i) for i in tok.encode(text)] + [stream.flush()]
        assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("style", list(STYLES))
def test_bos_and_end_of_turn(vocabularies, tokenizers, style):
    sp, _ = vocabularies[style]
    tok = tokenizers[style]
    # add_bos_token: encode(add_special_tokens=True) adds BOS, as llama.cpp does.
    assert tok.encode("Hello world", add_special_tokens=True) == [sp.bos_id(), *sp.encode("Hello world")]
    assert tok.bos_token_id == sp.bos_id() and sp.eos_id() in tok.eos_token_ids
    if style == "gemma":
        assert sp.piece_to_id("<end_of_turn>") in tok.eos_token_ids  # stops a Gemma turn


@pytest.mark.parametrize(("style", "arch"), CASES, ids=[f"{s}-{a}" for s, a in CASES])
def test_chat_template_renders_tools_turn(vocabularies, pairs, style, arch):
    sp, _ = vocabularies[style]
    loaded = load_model(str(pairs[style, arch][0]))
    tok = loaded.tokenizer
    text = tok.apply_chat_template(TOOL_TURN, tools=TOOLS)
    ids = tok.encode(text)
    assert ids == reference_ids(sp, style, text)
    assert ids[0] == sp.bos_id() and text.startswith("<s>")
    if style == "mistral":
        assert text.startswith('<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"')
        assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>' in text
        assert '[TOOL_RESULTS] {"content": "18C and sunny"}[/TOOL_RESULTS]' in text
        markers = ["[AVAILABLE_TOOLS]", "[INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]"]
    else:
        assert '```tool_call\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```<end_of_turn>' in text
        assert "<tool_response>\n18C and sunny\n</tool_response>" in text and text.endswith("<start_of_turn>model\n")
        markers = ["<start_of_turn>", "<end_of_turn>"]
    for marker in markers:  # each control token is one id, as the model was trained on it
        assert ids.count(sp.piece_to_id(marker)) == text.count(marker) > 0


@pytest.mark.parametrize(("style", "arch"), CASES, ids=[f"{s}-{a}" for s, a in CASES])
def test_gguf_matches_mlx_folder(pairs, style, arch):
    gguf_file, folder = pairs[style, arch]
    ids_gguf, logits_gguf = greedy(load_model(str(gguf_file)))
    ids_folder, logits_folder = greedy(load_model(str(folder)))
    np.testing.assert_allclose(logits_gguf, logits_folder, rtol=1e-3, atol=1e-3)
    assert ids_gguf == ids_folder


def test_structured_output_compiles_for_a_sentencepiece_vocabulary(tokenizers):
    from kiln.worker.structured import GrammarCompiler

    compiler = GrammarCompiler.from_tokenizer(tokenizers["gemma"])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert compiler.processor_for({"type": "json_schema", "name": "x", "schema": schema}) is not None


def test_flat_scores_merge_in_piece_order(vocabularies):
    """A GGUF converted from tokenizer.json alone carries -1000 for every score (gguf-py's
    LlamaHfVocab); SentencePiece orders pieces by score, so their order is used instead."""
    sp, md = vocabularies["mistral"]
    flat = build_hf_tokenizer({**md, "tokenizer.ggml.scores": np.full(len(md["tokenizer.ggml.tokens"]), -1000.0, np.float32)})
    for text in varied_texts("mistral", n=300):
        assert flat.encode(text, add_special_tokens=False).ids == reference_ids(sp, "mistral", text)


def test_phi3_cut_tokens_strip_the_whitespace_after_them(vocabularies):
    """llama.cpp gives Phi-3's special tokens (by general.name) the right-strip its
    tokenizer.json has: "<|user|>\\n" tokenizes as "<|user|>"."""
    _, md = vocabularies["mistral"]

    def ids(name: str, text: str) -> list[int]:
        return build_hf_tokenizer({**md, "general.name": name}).encode(text, add_special_tokens=False).ids

    assert ids("Phi3", "[INST] \n hello") == ids("Phi3", "[INST]hello") != ids("Mistral", "[INST] \n hello")
    assert ids("Phi3", "<s> hello") == ids("Mistral", "<s> hello")  # <s> keeps its space, as in llama.cpp


def test_vocabulary_without_scores_is_refused(vocabularies):
    _, md = vocabularies["gemma"]
    with pytest.raises(UnsupportedTokenizerError, match="SentencePiece GGUF vocabulary without tokenizer.ggml.scores"):
        build_hf_tokenizer({k: v for k, v in md.items() if k != "tokenizer.ggml.scores"})
