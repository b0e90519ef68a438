"""Incremental detokenization that never splits a character."""

from __future__ import annotations

from collections.abc import Callable

# How many already-emitted tokens are re-decoded for context: byte-level BPE needs a few to join
# a multi-byte character, and SentencePiece-style decoders need one to place leading spaces.
_CONTEXT = 4


class IncrementalDecoder:
    """Turns a growing token sequence into text deltas.

    Decoding a short window (a few context tokens plus the new ones) keeps each step O(1), and
    holding back text that ends in U+FFFD keeps a multi-byte character from being split.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._start = 0  # window start
        self._emitted = 0  # tokens whose text has been emitted

    def add(self, token: int) -> str:
        self._tokens.append(token)
        prefix = self._decode(self._tokens[self._start : self._emitted])
        full = self._decode(self._tokens[self._start :])
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :] if full.startswith(prefix) else full
        self._emitted = len(self._tokens)
        self._start = max(0, self._emitted - _CONTEXT)
        return delta

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character decodes as U+FFFD)."""
        if self._emitted == len(self._tokens):
            return ""
        prefix = self._decode(self._tokens[self._start : self._emitted])
        full = self._decode(self._tokens[self._start :])
        self._emitted = len(self._tokens)
        return full[len(prefix) :] if full.startswith(prefix) else full
