"""A SentencePiece GGUF vocabulary (`tokenizer.ggml.model == "llama"`) as a HF `tokenizers` pipeline.

What llama.cpp does with such a vocabulary (its SPM tokenizer, llama-vocab.cpp), which is also
what SentencePiece's own BPE model does with the tokenizer.model it came from:

1. the text is cut at special and user-defined tokens (matched whole, before anything else);
2. each remaining fragment gets a leading space when `add_space_prefix` is set and the fragment
   is the first one or follows a cut-out token, and every " " becomes "▁";
3. the fragment is split into characters, and the adjacent pair whose concatenation is a piece
   with the highest score is merged, again and again, until no pair forms a piece;
4. a character that is not a piece becomes its UTF-8 bytes, the `<0xXX>` tokens.

Step 3 is BPE whose merge priority is the merged piece's score, not a Unigram (Viterbi) model
over the scores: the two disagree on ordinary text (e.g. Llama 2's vocabulary), so the pipeline
here is a `BPE` model with `byte_fallback`, its merges derived from the vocabulary: every split
of a piece into two pieces, ranked by the score of the whole. Steps 1-2 are added tokens and a
normalizer (Prepend "▁", Replace " " -> "▁") with no pre-tokenizer, so that each fragment is one
BPE word, as it is one SPM session in llama.cpp.

Where ranks can only approximate llama.cpp: pieces with exactly equal scores. llama.cpp merges
the leftmost of equally scored pairs first; a BPE rank orders pairs, not positions. Among
equally scored merges longer results rank first, which reproduces llama.cpp on the one place
real vocabularies tie: Llama 2's runs of "▁" (all scored -1e9), which both then split
left-greedily into the longest runs the vocabulary has (16).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

SPACE = "\u2581"  # "▁", SentencePiece's visible space


def spm_merges(tokens: Sequence[str], scores: Sequence[float], mergeable: Sequence[bool]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece/llama.cpp's score-ordered pair merging.

    A pair (left, right) is a merge when left + right is a `mergeable` piece and both halves are
    pieces; it ranks by the whole's score (highest first), then by the whole's length (longest
    first, see the module docstring), then by id and split point so that the order is total.
    """
    vocab = _first_ids(tokens)
    has = vocab.__contains__
    ranked: list[tuple[tuple[float, int, int], int, str, str]] = []
    for i, piece in enumerate(tokens):
        n = len(piece)
        if n < 2 or not mergeable[i] or vocab[piece] != i:
            continue
        key = (-float(scores[i]), -n, i)
        for k in range(1, n):
            left = piece[:k]
            if has(left) and has(right := piece[k:]):
                ranked.append((key, k, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _first_ids(tokens: Sequence[str]) -> dict[str, int]:
    """Piece -> id; a piece listed twice keeps its first id."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def spm_tokenizer(
    tokens: Sequence[str],
    scores: Sequence[float],
    mergeable: Sequence[bool],
    *,
    add_space_prefix: bool,
    unk_token: str | None,
) -> HFTokenizer:
    """The BPE model, normalizer and decoder for a SentencePiece vocabulary.

    Added tokens (special, user-defined) and the post-processor are the caller's: they are the
    same for every GGUF vocabulary kind.
    """
    tok = HFTokenizer(
        models.BPE(
            vocab=_first_ids(tokens),
            merges=spm_merges(tokens, scores, mergeable),
            unk_token=unk_token,
            fuse_unk=False,
            byte_fallback=True,
            ignore_merges=False,
        )
    )
    steps: list[normalizers.Normalizer] = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = None
    # Decoding undoes both: "▁" back to " ", <0xXX> runs back to their characters, and the one
    # space the prefix added at the start dropped (as llama.cpp's detokenizer drops it).
    parts: list[decoders.Decoder] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        parts.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(parts)
    return tok
