"""Token usage, one type for every hop: the worker reports it, the gateway completes it for the
Response object, sums it with compaction's, bills it and counts it in /metrics.

On the wire (``Event.usage``, ``Done.usage``, ``Compacted.usage``) and in Response objects usage is
OpenAI's ``usage`` map; ``Usage.from_map`` reads any such map shallowly and forgivingly (absent or
malformed counts are 0, so an older or newer peer never breaks a bill), and ``to_map`` writes the
complete shape the Responses schema requires. Whether a reported usage is *plausible* for its
request is the worker pool's check (gateway/pool/workers.py), not this type's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @classmethod
    def from_map(cls, usage: Mapping[str, Any] | None) -> "Usage":
        """The counts of a Responses ``usage`` map (zeros for what is absent or malformed)."""
        if not isinstance(usage, Mapping):
            return cls()
        inp = usage.get("input_tokens_details")
        out = usage.get("output_tokens_details")
        inp = inp if isinstance(inp, Mapping) else {}
        out = out if isinstance(out, Mapping) else {}
        return cls(
            input_tokens=_count(usage.get("input_tokens")),
            cached_tokens=_count(inp.get("cached_tokens")),
            cache_write_tokens=_count(inp.get("cache_write_tokens")),
            output_tokens=_count(usage.get("output_tokens")),
            reasoning_tokens=_count(out.get("reasoning_tokens")),
        )

    def to_map(self) -> dict[str, Any]:
        """The Responses ``usage`` object, every required field present."""
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": self.cache_write_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.total_tokens,
        }

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(
            self.input_tokens + other.input_tokens,
            self.cached_tokens + other.cached_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
            self.output_tokens + other.output_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
        )
