"""Tiny real SentencePiece models, trained in the test, and their GGUF tokenizer metadata.

`train(style)` trains a BPE SentencePiece model with the `sentencepiece` package (a few hundred
milliseconds) the way the models users run are trained: byte fallback, identity normalization,
whitespace kept, digits split. Two styles:

- "mistral": a dummy-prefix ("▁" before the text) vocabulary with Mistral v0.3's tool control
  tokens, as Llama 2 / Mistral / Phi-3 GGUFs have;
- "gemma": no dummy prefix, <start_of_turn>/<end_of_turn> control tokens and user-defined
  pieces (an HTML tag, a run of spaces), as Gemma's GGUFs have.

`gguf_metadata(sp, style)` writes what llama.cpp's converter (convert_hf_to_gguf.py,
`_create_vocab_sentencepiece`) writes for such a model: every piece with its score and type,
user-defined pieces with "▁" turned back into spaces, `add_space_prefix` from the model's
normalizer spec, BOS/EOS/UNK ids. `reference_ids` is what llama.cpp gives for a text: control
tokens cut out whole, SentencePiece itself on each fragment between them.
"""

from __future__ import annotations

import io
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import sentencepiece as spm

_WORDS = (
    "the quick brown fox jumps over lazy dog model server token stream request response cache weight "
    "layer tensor quantize naïve café résumé über Straße год мир привет данные 東京 日本語 function call "
    "tools weather Paris London 2024 3.14 100% $5 e-mail user@example.com if else return def class "
    "print(x) {\"a\": 1} <div> </div>"
).split()

# Mistral v0.3's control tokens for tools (its SentencePiece vocabulary has them as pieces).
MISTRAL_CONTROL = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]  # fmt: skip
GEMMA_CONTROL = ["<start_of_turn>", "<end_of_turn>"]
GEMMA_USER = ["<h1>", "\u2581" * 8]  # matched whole; the second is eight spaces

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}}[/TOOL_RESULTS]"
    "{% elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}{% endfor %}]{{ eos_token }}"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<start_of_turn>user\nTools:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<end_of_turn>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}"
    "<start_of_turn>user\n<tool_response>\n{{ m.content }}\n</tool_response><end_of_turn>\n"
    "{% else %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}```tool_call\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n```{% endfor %}<end_of_turn>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# GGUF token types (llama.cpp).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class Style:
    add_dummy_prefix: bool
    control: list[str]
    user_defined: list[str]
    template: str


STYLES = {
    "mistral": Style(True, MISTRAL_CONTROL, [], MISTRAL_TEMPLATE),
    "gemma": Style(False, GEMMA_CONTROL, GEMMA_USER, GEMMA_TEMPLATE),
}


def _corpus(n: int = 3000, seed: int = 0) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(n):
        sep = rng.choice([" ", " ", " ", "  ", "\t", "\n", "    "])
        line = sep.join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14)))
        if rng.random() < 0.3:
            line = line.capitalize() + "."
        if rng.random() < 0.2:
            line = " ".join(str(rng.randint(0, 99999)) for _ in range(3)) + " " + line
        yield line


def train(style: str, vocab_size: int = 800) -> spm.SentencePieceProcessor:
    """A BPE SentencePiece model trained on a fixed synthetic corpus."""
    spec = STYLES[style]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_corpus(), model_writer=out, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=spec.add_dummy_prefix, allow_whitespace_only_pieces=True, split_digits=True,
        control_symbols=spec.control, user_defined_symbols=spec.user_defined, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, num_threads=1, character_coverage=1.0, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def gguf_metadata(sp: spm.SentencePieceProcessor, style: str) -> dict[str, Any]:
    """The `tokenizer.*` keys llama.cpp's converter writes for `sp`."""
    spec = STYLES[style]
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if piece in spec.user_defined:  # listed as added tokens: pre-normalized, as the converter does
            tokens.append(piece.replace("\u2581", " "))
            types.append(_USER_DEFINED)
        else:
            tokens.append(piece)
            types.append(_UNKNOWN if sp.is_unknown(i) else _CONTROL if sp.is_control(i)
                         else _UNUSED if sp.is_unused(i) else _BYTE if sp.is_byte(i) else _NORMAL)  # fmt: skip
        scores.append(sp.get_score(i))
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array(scores, np.float32),
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": spec.add_dummy_prefix,
        "tokenizer.chat_template": spec.template,
    }


def reference_ids(sp: spm.SentencePieceProcessor, style: str, text: str) -> list[int]:
    """llama.cpp's ids for `text`: control tokens (and <s>, </s>, <unk>) and user-defined ones
    (as the GGUF spells them, with spaces) cut out of the raw text whole, longest first,
    SentencePiece on each fragment between them. (SentencePiece alone matches user-defined
    pieces after turning spaces into "▁", so it differs from llama.cpp only on text that holds
    a literal "▁" next to such a piece.)"""
    spec = STYLES[style]
    cut = {t: sp.piece_to_id(t) for t in [*spec.control, "<s>", "</s>", "<unk>"]}
    cut.update({t.replace("\u2581", " "): sp.piece_to_id(t) for t in spec.user_defined})
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, sorted(cut, key=len, reverse=True))) + ")", text):
        if part in cut:
            ids.append(cut[part])
        elif part:
            ids.extend(sp.encode(part))
    return ids


def varied_texts(style: str, n: int = 1500, seed: int = 1) -> list[str]:
    """Unicode, whitespace runs, tabs/newlines/CR, digits, emoji (not in the vocabulary: byte
    fallback), the literal "<0x41>" and "▁", control and user-defined tokens inside text.

    (No literal "▁" beside a user-defined run of spaces: SentencePiece would match the piece
    across it, llama.cpp, which cuts user-defined tokens from the raw text, does not.)"""
    rng = random.Random(seed)
    spec = STYLES[style]
    literal_space = [] if any("\u2581" in u for u in spec.user_defined) else ["\u2581"]
    alphabet = list("abcdefghij ABC  \t\n\r0123456789.,!?'\"-_") + [
        "é", "ü", "ß", "д", "и", "東", "京", "中", "😀", "🦙", "\u00a0", "\u3000", "<0x41>", *literal_space,
        " " * 30, "\n\n", *spec.control, "<s>", *[u.replace("\u2581", " ") for u in spec.user_defined],
    ]  # fmt: skip
    fixed = ["", " ", "  ", "\n", "Hello world", " Hello world", "Hello  world ", "\t\tindented\n  code",
             "12345 67890", "3.14159", "😀🦙", "東京 日本語 中文", "naïve café", "a" + " " * 100 + "b"]  # fmt: skip
    randoms = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(n)]
    sentences = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 30))) for _ in range(n // 3)]
    return fixed + randoms + sentences
