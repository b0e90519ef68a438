"""A cheap, provable lower bound on a text's token count, to refuse huge prompts untokenized.

Tokenizing a 10 MB prompt takes seconds and a pile of memory only to learn that it does not fit
the context window. No token covers more than ``max_token_bytes`` bytes of (normalized) text,
computed once from the vocabulary, so ``tokens >= bytes / max_token_bytes`` for any text: when
that already exceeds the window the prompt is refused without tokenizing it.

Per token, the bytes it can cover: for a byte-level (GPT-2 style) vocabulary each character of
a piece stands for one byte; for any other vocabulary a piece's own UTF-8 length is an upper
bound (SentencePiece's "▁" is 3 bytes standing for a 1-byte space, byte-fallback "<0x0A>" is 6
for 1); added tokens such as "<|im_start|>" are matched as their literal text.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("kiln.worker.prompt_bound")


def max_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes of text one token can stand for; None when it cannot be known."""
    try:
        hf = getattr(tokenizer, "hf_tokenizer", None)
        if hf is not None:
            return _from_hf(hf)
        # Any other tokenizer (the scripted engine's bytes): decode each id on its own.
        size = int(tokenizer.vocab_size)
        return max(1, max(len(tokenizer.decode([i]).encode("utf-8", "surrogatepass")) for i in range(size)))
    except Exception:  # no bound is safe: every prompt is then tokenized
        log.exception("could not bound the bytes per token; prompts are always tokenized")
        return None


def _from_hf(hf: Any) -> int:
    added = {t.content for t in hf.get_added_tokens_decoder().values()}
    byte_level = _is_byte_level(hf)
    longest = 1
    for piece in hf.get_vocab(with_added_tokens=True):
        size = len(piece) if byte_level and piece not in added else len(piece.encode("utf-8", "surrogatepass"))
        longest = max(longest, size)
    return longest


def _is_byte_level(hf: Any) -> bool:
    """Whether pieces are spelled in GPT-2's byte alphabet (one character per byte)."""
    for component in (hf.pre_tokenizer, hf.decoder):
        if component is not None and '"ByteLevel"' in json.dumps(json.loads(component.__getstate__())):
            return True
    return False


class PromptBound:
    """Refuses texts that provably hold more tokens than a limit, for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.max_bytes = max_token_bytes(tokenizer)
        hf = getattr(tokenizer, "hf_tokenizer", None)
        normalizer = getattr(hf, "normalizer", None)
        # Pieces are spelled in normalized text; a normalizer may shorten text (NFKC "ﬁ" -> "fi").
        self._normalize = normalizer.normalize_str if normalizer is not None else None

    def exceeds(self, text: str, limit: int) -> int | None:
        """A lower bound on the tokens of ``text`` when it proves more than ``limit``, else None.

        Costs nothing for ordinary prompts: the character count bounds the byte count from below
        (and 4 x characters from above), so the text is only encoded when it is near the limit,
        and only normalized (a copy) to confirm a refusal.
        """
        lower = _exceeds(text, self.max_bytes, limit)
        if lower is not None and self._normalize is not None:
            lower = _exceeds(self._normalize(text), self.max_bytes, limit)
        return lower


def _exceeds(text: str, max_bytes: int | None, limit: int) -> int | None:
    if max_bytes is None:
        return None
    chars = len(text)
    if 4 * chars <= limit * max_bytes:
        return None  # even all 4-byte characters could fit
    lower = -(-chars // max_bytes)
    if lower <= limit and not text.isascii():
        lower = -(-len(text.encode("utf-8", "surrogatepass")) // max_bytes)
    return lower if lower > limit else None
