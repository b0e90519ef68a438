"""Incremental detokenization: token ids in, text deltas out.

Streaming needs text as soon as it is final, but one token can hold part of a
UTF-8 character (byte-level BPE splits emoji and CJK across tokens). For
byte-level vocabularies we map every token to its raw bytes once and decode a
byte buffer incrementally, emitting only complete characters. For other
vocabularies (SentencePiece-style) we re-decode a window of ids instead: the ids
emitted last (as context) plus the new ones, and emit the new suffix once it no
longer ends in U+FFFD.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (char -> byte).

    Byte-level BPE stores each byte as a printable code point: the printable
    Latin-1 bytes stand for themselves and the rest are shifted to 256 and up.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars: dict[str, int] = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


def token_byte_table(hf: HFTokenizer, special_ids: frozenset[int]) -> list[bytes]:
    """The raw bytes of every id of a byte-level vocabulary.

    Added tokens (e.g. `<|im_start|>`) are stored as plain text, not in the
    byte alphabet, so they map to their UTF-8 encoding.
    """
    alphabet = byte_level_alphabet()
    added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
    size = hf.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = [b""] * size
    for token, i in hf.get_vocab(with_added_tokens=True).items():
        if i >= size:
            table.extend([b""] * (i + 1 - size))
            size = i + 1
        if i in added or i in special_ids:
            table[i] = token.encode("utf-8")
        elif all(c in alphabet for c in token):
            table[i] = bytes(alphabet[c] for c in token)
        else:
            # Not in the byte alphabet: a literal token; keep its text.
            table[i] = token.encode("utf-8")
    return table


class StreamDecoder:
    """Feed token ids, receive text deltas that never split a character.

    Concatenating every `feed()` result and the final `flush()` equals
    `Tokenizer.decode(all_ids, skip_special_tokens=...)` for byte-level
    vocabularies. Not thread-safe: one decoder per stream.
    """

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        byte_table: Sequence[bytes] | None,
        special_ids: frozenset[int],
        skip_special_tokens: bool = False,
    ) -> None:
        self._hf = hf
        self._table = byte_table
        self._special = special_ids
        self._skip = skip_special_tokens
        # Byte path state.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Window path state: the window's ids, of which the first `_context` were emitted.
        self._ids: list[int] = []
        self._context = 0

    def feed(self, ids: int | Iterable[int]) -> str:
        """Add one id or several; return the newly completed text (may be empty)."""
        batch = [ids] if isinstance(ids, int) else list(ids)
        if self._skip:
            batch = [i for i in batch if i not in self._special]
        if not batch:
            return ""
        if self._table is not None:
            table = self._table
            data = b"".join(table[i] if 0 <= i < len(table) else b"" for i in batch)
            return self._utf8.decode(data)
        return self._feed_window(batch)

    def flush(self) -> str:
        """Return whatever is buffered (incomplete bytes become U+FFFD) and reset."""
        if self._table is not None:
            return self._utf8.decode(b"", final=True)
        rest = self._window_delta()
        self._ids, self._context = [], 0
        return rest

    def _feed_window(self, batch: list[int]) -> str:
        self._ids.extend(batch)
        delta = self._window_delta()
        if delta.endswith("\ufffd"):
            return ""  # waiting for the rest of a character
        # The ids just emitted are the next window's context. Decoding them again with what
        # follows reproduces what a whole decode does at that point: SentencePiece decoders
        # drop a leading space only at the start of a sequence, and byte-fallback tokens
        # (<0xF0><0x9F>...) decode jointly with their neighbours in a run. Starting right after
        # an emission also means the window never starts inside a character.
        self._ids = self._ids[self._context :]
        self._context = len(self._ids)
        return delta

    def _window_delta(self) -> str:
        text = self._hf.decode(self._ids, skip_special_tokens=False)
        done = self._hf.decode(self._ids[: self._context], skip_special_tokens=False) if self._context else ""
        return text[len(done) :]
