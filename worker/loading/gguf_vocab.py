"""Build a Hugging Face `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

A GGUF carries the vocabulary (`tokenizer.ggml.tokens`), the BPE merges, one
type per token and a pre-tokenizer name (`tokenizer.ggml.pre`) that llama.cpp
maps to a split regex. We rebuild the equivalent HF pipeline so that the
worker tokenizes exactly as the model's original `tokenizer.json` would, and so
that llguidance can be built from the same object.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported; that is
what llama-architecture GGUFs of GPT-2/StarCoder/Llama-3 lineage use.
"""

from __future__ import annotations

from typing import Any, Mapping

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

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


def _added(text: str, *, special: bool) -> AddedToken:
    return AddedToken(
        text, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False
    )


def build_hf_tokenizer(md: Mapping[str, Any]) -> HFTokenizer:
    """Return a byte-level BPE `tokenizers.Tokenizer` equivalent to the GGUF's."""
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')"
        )
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
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

    # Control tokens are HF "special" added tokens: matched whole in input text
    # and droppable with skip_special_tokens. User-defined ones are matched
    # whole too but decoded like text.
    types = _token_types(md, len(tokens))
    special: list[AddedToken] = []
    user: list[AddedToken] = []
    for text, type_id in zip(tokens, types):
        if type_id == TOKEN_TYPE_CONTROL:
            special.append(_added(text, special=True))
        elif type_id == TOKEN_TYPE_USER_DEFINED:
            user.append(_added(text, special=False))
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok


def special_token_id(md: Mapping[str, Any], name: str) -> int | None:
    """The id stored under `tokenizer.ggml.<name>_token_id`, if any."""
    value = md.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(_scalar(value))
