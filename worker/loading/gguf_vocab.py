"""Build a Hugging Face `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

A GGUF carries the vocabulary (`tokenizer.ggml.tokens`), one type per token and,
by `tokenizer.ggml.model`, either
- "gpt2": byte-level BPE with its merges and a pre-tokenizer name (`tokenizer.ggml.pre`)
  that llama.cpp maps to a split regex (GPT-2/StarCoder/Llama-3/Qwen lineage), or
- "llama": a SentencePiece vocabulary with one score per piece (Llama 2, Mistral v0.1-v0.3,
  Phi-3, Gemma), rebuilt by `gguf_spm`.
We rebuild the equivalent HF pipeline so that the worker tokenizes exactly as llama.cpp (and
the model's original tokenizer) would, and so that llguidance can be built from the same
object. Special and user-defined tokens are the same for both kinds: cut out of the text whole
before anything else, as llama.cpp does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from .gguf_spm import spm_tokenizer

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Llama-3 style split (also used by several later byte-level vocabularies).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2 differs from Llama-3 only in splitting digits one by one.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class UnsupportedTokenizerError(ValueError):
    """The GGUF's tokenizer model or pre-tokenizer is one we cannot rebuild."""


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Map llama.cpp's pre-tokenizer name to the HF pre-tokenizer chain."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        # StarCoder lineage: every digit is its own pre-token, then GPT-2 split.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre in ("gpt2", "gpt-2", "default", ""):
        return byte_level
    if pre in ("llama3", "llama-bpe", "llama-v3"):
        split = _LLAMA3_SPLIT
    elif pre == "qwen2":
        split = _QWEN2_SPLIT
    else:
        raise UnsupportedTokenizerError(
            f"GGUF pre-tokenizer {pre!r} is not supported "
            "(supported: smollm, starcoder, refact, gpt2, default, llama-bpe, qwen2)"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _scalar(value: Any) -> Any:
    # mx.load returns GGUF scalars as 0-d mx.arrays; plain values pass through.
    return value.item() if hasattr(value, "item") else value


def _token_types(md: Mapping[str, Any], n: int) -> list[int]:
    raw = md.get("tokenizer.ggml.token_type")
    if raw is None:
        return [TOKEN_TYPE_NORMAL] * n
    return [int(t) for t in (raw.tolist() if hasattr(raw, "tolist") else raw)]


def _added(text: str, *, special: bool, rstrip: bool = False) -> AddedToken:
    return AddedToken(
        text, special=special, normalized=False, single_word=False, lstrip=False, rstrip=rstrip
    )


def build_hf_tokenizer(md: Mapping[str, Any]) -> HFTokenizer:
    """Return a `tokenizers.Tokenizer` equivalent to the GGUF's (byte-level BPE or SentencePiece)."""
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    types = _token_types(md, len(tokens))
    if kind == "gpt2":
        tok = _byte_level_bpe(md, tokens)
    elif kind == "llama":
        tok = _sentencepiece(md, tokens, types)
    else:
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )
    _add_cut_tokens(tok, md, tokens, types)
    if kind == "llama" and (post := _bos_eos(md, tokens)) is not None:
        tok.post_processor = post
    return tok


def _byte_level_bpe(md: Mapping[str, Any], tokens: list[str]) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    tok.pre_tokenizer = _pre_tokenizer(str(md.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    # trim_offsets only affects offsets; ids and text are unchanged.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece(md: Mapping[str, Any], tokens: list[str], types: list[int]) -> HFTokenizer:
    raw_scores = md.get("tokenizer.ggml.scores")
    if raw_scores is None:
        raise UnsupportedTokenizerError("SentencePiece GGUF vocabulary without tokenizer.ggml.scores")
    scores = [float(s) for s in (raw_scores.tolist() if hasattr(raw_scores, "tolist") else raw_scores)]
    if len(scores) != len(tokens):
        raise UnsupportedTokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    mergeable = [t == TOKEN_TYPE_NORMAL for t in types]
    if len({s for s, m in zip(scores, mergeable, strict=False) if m}) <= 1:
        # Converted from a tokenizer.json without its tokenizer.model (gguf-py's LlamaHfVocab
        # writes -1000 for every piece): no order to merge by but the pieces' own, which for a
        # SentencePiece vocabulary is by score. llama.cpp would merge leftmost-first instead.
        scores = [-float(i) for i in range(len(tokens))]
    unk_id = special_token_id(md, "unknown")
    if unk_id is None or not 0 <= unk_id < len(tokens):
        unk_id = next((i for i, t in enumerate(types) if t == TOKEN_TYPE_UNKNOWN), None)
    return spm_tokenizer(
        tokens,
        scores,
        mergeable,
        add_space_prefix=bool(_scalar(md.get("tokenizer.ggml.add_space_prefix", True))),
        unk_token=None if unk_id is None else tokens[unk_id],
    )


# llama.cpp gives Phi-3's cut-out tokens (by general.name) the right-strip attribute that the
# model's tokenizer.json gives them: whitespace after <|user|>, <|end|>, ... is dropped.
_PHI3_NAMES = ("phi-3", "phi3")
_PHI3_KEEP_SPACE = frozenset({"<unk>", "<s>", "<|endoftext|>"})


def _add_cut_tokens(tok: HFTokenizer, md: Mapping[str, Any], tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become HF "special" added tokens: matched whole in input text
    and droppable with skip_special_tokens. User-defined ones are matched whole too but decoded
    like text. (llama.cpp cuts the same three types out of the text before tokenizing.)"""
    name = str(md.get("general.name") or "").lower()
    phi3 = any(n in name for n in _PHI3_NAMES)
    special: list[AddedToken] = []
    user: list[AddedToken] = []
    for text, type_id in zip(tokens, types, strict=False):
        if not text:
            continue
        rstrip = phi3 and text not in _PHI3_KEEP_SPACE
        if type_id in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            special.append(_added(text, special=True, rstrip=rstrip))
        elif type_id == TOKEN_TYPE_USER_DEFINED:
            user.append(_added(text, special=False, rstrip=rstrip))
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _bos_eos(md: Mapping[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    """What `encode(add_special_tokens=True)` adds: BOS/EOS as `tokenizer.ggml.add_bos_token` /
    `add_eos_token` say (llama.cpp's SentencePiece defaults: BOS yes, EOS no)."""

    def mark(name: str, default: bool) -> list[tuple[str, int]]:
        token_id = special_token_id(md, name)
        wanted = bool(_scalar(md.get(f"tokenizer.ggml.add_{name}_token", default)))
        return [(tokens[token_id], token_id)] if wanted and token_id is not None and 0 <= token_id < len(tokens) else []

    bos, eos = mark("bos", True), mark("eos", False)
    if not bos and not eos:
        return None
    b, e = [t for t, _ in bos], [t for t, _ in eos]
    return processors.TemplateProcessing(
        single=[*b, "$A", *e], pair=[*b, "$A", *e, *b, "$B", *e], special_tokens=list(dict.fromkeys(bos + eos))
    )


def special_token_id(md: Mapping[str, Any], name: str) -> int | None:
    """The id stored under `tokenizer.ggml.<name>_token_id`, if any."""
    value = md.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(_scalar(value))
