"""Speculative decoding by prompt lookup: draft tokens copied from the row's own context.

Why: agents and editors repeat long spans of what they were given (a file rewritten with one
change, a quoted function, a tool call echoing its arguments). When the last few tokens of a row
occurred before, the tokens that followed them then are a cheap guess at what follows now; the
decode batch feeds the guess with the row's last token as one (B, T) block, and every draft the
row's own sampler would have drawn anyway is a token won without a step of its own. No draft
model: the index is a dict over the row's prompt and output.

``NgramIndex`` finds drafts; ``RowDrafts`` keeps a row's record of kept drafts, from which
``choose_width`` decides how many to feed (``auto`` drafts little where drafts keep being
rejected, so ordinary prose loses almost nothing).
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
    occurred before, every draft found; ``auto`` on a match of 3 or more tokens, as many drafts
    as its cost model expects to pay for the longer step (``choose_width``): rows whose drafts
    keep being accepted draft long, rows whose drafts miss draft little or not at all."""

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

    def seen(self, n: int) -> bool:
        """Whether the last ``n`` tokens (2 to 4) occurred before."""
        return len(self._tokens) >= n and tuple(self._tokens[-n:]) in self._after

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


# auto's model of a step's cost: a fixed part plus TOKEN_COST of it per token fed, as measured for
# the native CPU pass on the bundled model on the 2-core development machine (~6.5 ms a step plus
# ~4.5 ms a token: a 1-row step feeding 5 tokens took 2.75x one feeding 1, 8 rows of 2 tokens 1.9x
# 8 rows of 1; the products are bound by arithmetic, not by reading the weights). And of a row's
# drafts: each next one is kept with probability ``acceptance``: the row's recent record (each step
# that fed drafts weighs the past by _FORGET, each step that did not by _FORGET_QUIET) on top of a
# prior of _PRIOR_HITS / (_PRIOR_HITS + _PRIOR_MISSES). Under this model a lone row keeps drafting
# while more than ~40 % of its drafts are kept; one whose drafts stop being kept drafts fewer at
# once and none after a miss or two, and tries again after a few quiet steps.
TOKEN_COST = 0.7
_AUTO_MIN_MATCH = 3
_PRIOR_HITS, _PRIOR_MISSES = 0.9, 0.6
_FORGET = 0.5
_FORGET_QUIET = 0.9


class RowDrafts:
    """One row's lookup index and its record of how its drafts fared."""

    def __init__(self, config: Speculation, tokens: Sequence[int]) -> None:
        self.config = config
        self.index = NgramIndex(tokens)
        self._hits = 0.0  # drafts kept (recent ones count more)
        self._misses = 0.0  # steps where a draft was rejected

    @property
    def acceptance(self) -> float:
        """The chance that the row's next draft is kept, given the one before it was."""
        return (self._hits + _PRIOR_HITS) / (self._hits + self._misses + _PRIOR_HITS + _PRIOR_MISSES)

    def sync(self, cached: Sequence[int], pending: int) -> None:
        """Catch the index up with the row: ``cached`` (the tokens whose KV is in the batch
        cache, which only grows) and ``pending``, the token the next step feeds."""
        if len(self.index) < len(cached):
            self.index.extend(cached[len(self.index) :])
        self.index.extend((pending,))

    def may_match(self, cached: Sequence[int]) -> bool:
        """Whether the row may have drafts once its pending token is known: a match of n tokens
        ending with it needs the n - 1 known tokens before it to have occurred before."""
        if len(self.index) < len(cached):
            self.index.extend(cached[len(self.index) :])
        return self.config.mode == "on" or self.index.seen(_AUTO_MIN_MATCH - 1)

    def propose(self, room: int) -> list[int]:
        """Drafts for the next step (at most ``room``: the tokens the row may still deliver
        after the one the step samples anyway); the batch may feed fewer."""
        limit = min(self.config.tokens, room)
        if self.config.mode == "off" or limit <= 0:
            return []
        return self.index.propose(limit, 2 if self.config.mode == "on" else _AUTO_MIN_MATCH)[0]

    def record(self, fed: int, kept: int) -> None:
        """A step fed ``fed`` of the row's drafts (0: none) and its sampler kept ``kept``."""
        forget = _FORGET if fed else _FORGET_QUIET
        self._hits *= forget
        self._misses *= forget
        self._hits += kept
        self._misses += 1 if kept < fed else 0


def choose_width(drafts: list[list[int]], acceptance: list[float], token_cost: float = TOKEN_COST) -> int:
    """The block width (1 + drafts fed per row) that ``auto`` expects to deliver the most tokens
    per unit of step time, rows with fewer drafts padded to it; 1 is a plain step."""
    rows = len(drafts)
    best, best_rate = 1, rows / (1 + token_cost * rows)
    for width in range(2, 2 + max((len(d) for d in drafts), default=0)):
        expected = sum(1 + sum(p**j for j in range(1, 1 + min(width - 1, len(d)))) for d, p in zip(drafts, acceptance, strict=False))
        rate = expected / (1 + token_cost * rows * width)
        if rate > best_rate:
            best, best_rate = width, rate
    return best


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
