"""Speculative decoding by prompt lookup: draft tokens copied from the row's own context.

Why: agents and editors repeat long spans of what they were given (a file rewritten with one
change, a quoted function, a tool call echoing its arguments). When the last few tokens of a row
occurred before, the tokens that followed them then are a cheap guess at what follows now; the
decode batch feeds the guess with the row's last token as one (B, T) block, and every draft the
row's own sampler would have drawn anyway is a token won without a step of its own. No draft
model: the index is a dict over the row's prompt and output.

``NgramIndex`` finds drafts; ``RowDrafts`` decides, per row, whether drafting pays (``auto``
backs off a row whose drafts keep being rejected, so ordinary prose loses almost nothing).
Nothing here touches mlx: batch.py feeds, verifies and repairs the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Mode = Literal["auto", "on", "off"]
MODES: tuple[Mode, ...] = ("auto", "on", "off")

# Suffix lengths looked up, longest first: a longer match predicts better.
NGRAMS = (4, 3, 2)


@dataclass(frozen=True)
class Speculation:
    """How the decode batch drafts: ``off`` never; ``on`` whenever a row's last 2-4 tokens
    occurred before; ``auto`` on a match of 3 or more tokens while the row's recent drafts
    were mostly accepted (it pauses a row whose drafts miss, longer each time)."""

    mode: Mode = "auto"
    tokens: int = 4  # drafts per row per step, at most

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(MODES)}")
        if self.tokens < 1:
            raise ValueError("speculative tokens must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


class NgramIndex:
    """For each 2-, 3- and 4-token n-gram of a token sequence, where the token that followed its
    latest occurrence stands. Appending is O(1) per token; a lookup is one dict probe per length."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self._tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        seq, after = self._tokens, self._after
        for token in tokens:
            end = len(seq)
            # The n-grams ending just before `end` are now followed by a token: index them. The
            # row's current suffix is indexed only once something follows it, so a lookup of it
            # finds an earlier occurrence, never itself.
            for n in NGRAMS:
                if end >= n:
                    after[tuple(seq[end - n : end])] = end
            seq.append(token)

    def propose(self, limit: int, min_match: int = 2) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest
        suffix (of at least ``min_match`` tokens) seen before, and that suffix's length; ([], 0)
        when none was."""
        seq = self._tokens
        if limit <= 0:
            return [], 0
        for n in NGRAMS:
            if n < min_match or len(seq) < n:
                continue
            start = self._after.get(tuple(seq[-n:]))
            if start is not None:
                return seq[start : start + limit], n
        return [], 0


# auto: a row drafts while the moving average of drafts accepted per drafted step stays at or
# above _AUTO_KEEP (a step of T tokens costs more than a step of one; about half a token won per
# step pays for it on the CPU, see docs/performance.md). Below it the row pauses for _PAUSE_FIRST
# steps, doubling up to _PAUSE_MAX while its drafts keep missing.
_AUTO_MIN_MATCH = 3
_AUTO_KEEP = 0.5
_EMA = 0.3
_PAUSE_FIRST = 4
_PAUSE_MAX = 64


class RowDrafts:
    """One row's lookup index and its record of how its drafts fared."""

    def __init__(self, config: Speculation, tokens: Sequence[int]) -> None:
        self.config = config
        self.index = NgramIndex(tokens)
        self._accepted = 1.0  # moving average of drafts accepted per drafted step (optimistic)
        self._paused = 0  # steps left without drafting
        self._pause = _PAUSE_FIRST  # the next pause's length

    def sync(self, cached: Sequence[int], pending: int) -> None:
        """Catch the index up with the row: ``cached`` (the tokens whose KV is in the batch
        cache, which only grows) and ``pending``, the token the next step feeds."""
        if len(self.index) < len(cached):
            self.index.extend(cached[len(self.index) :])
        self.index.extend((pending,))

    def propose(self, room: int) -> list[int]:
        """Drafts for the next step (at most ``room``: the tokens the row may still deliver
        after the one the step samples anyway), or [] when the row should not draft now."""
        limit = min(self.config.tokens, room)
        if self.config.mode == "off" or limit <= 0:
            return []
        if self.config.mode == "on":
            return self.index.propose(limit)[0]
        if self._paused:
            self._paused -= 1
            return []
        return self.index.propose(limit, _AUTO_MIN_MATCH)[0]

    def record(self, proposed: int, accepted: int) -> None:
        """How many of a step's ``proposed`` drafts the row's sampler kept."""
        if not proposed:
            return
        self._accepted += _EMA * (accepted - self._accepted)
        if self.config.mode != "auto":
            return
        if self._accepted < _AUTO_KEEP:
            self._paused = self._pause
            self._pause = min(self._pause * 2, _PAUSE_MAX)
            self._accepted = 1.0  # the next try starts afresh
        elif accepted:
            self._pause = _PAUSE_FIRST


@dataclass
class DecodeStats:
    """Running totals of the decode batch, for the worker's stats: ``tokens / row_steps`` is the
    tokens a row gets per step (1.0 without speculation), ``accepted / drafted`` the hit rate."""

    row_steps: int = 0  # rows advanced, summed over steps
    tokens: int = 0  # tokens delivered
    verify_steps: int = 0  # steps that fed drafts
    drafted: int = 0  # draft tokens fed
    accepted: int = 0  # of which kept

    def as_dict(self) -> dict[str, int]:
        return {
            "decode_row_steps": self.row_steps,
            "decode_tokens": self.tokens,
            "speculative_steps": self.verify_steps,
            "draft_tokens": self.drafted,
            "accepted_draft_tokens": self.accepted,
        }
