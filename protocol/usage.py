"""Token usage, one type for every hop: the worker reports it, the gateway completes it for the
Response object, sums it with compaction's, bills it and counts it in /metrics.

On the wire (``Event.usage``, ``Done.usage``, ``Compacted.usage``) a ``Usage`` travels as OpenAI's
``usage`` map. ``from_wire`` reads a worker's report strictly: a count that is not a non-negative
integer, or a detail beyond its total, raises ``InvalidUsage``, which the codec turns into a
``BadReport`` and the worker pool into dropping the worker (a report that cannot be true). Whether
a well-formed usage is *possible for its request* (within its limits) is the pool's check
(gateway/pool/workers.py). In stored Response objects usage is the same map; ``from_map`` reads it
forgivingly (absent or malformed counts are 0: a stored object never breaks a bill), and ``to_map``
writes the complete shape the Responses schema requires.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def is_count(value: Any) -> bool:
    """A count as the wire carries one: a non-negative integer (JSON and msgpack keep booleans
    apart, and so does this)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def count_or_zero(value: Any) -> int:
    """``value`` where it is a count, else 0 (a peer's malformed count never breaks a sum)."""
    return value if is_count(value) else 0


class InvalidUsage(ValueError):
    """A usage report that no request can have (not a count, or a detail beyond its total)."""


def _wire_count(usage: Mapping[str, Any], key: str, where: str = "") -> int:
    value = usage.get(key, 0)
    if not is_count(value):
        raise InvalidUsage(f"{where}{key} is not a non-negative integer")
    return int(value)


def _details(usage: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    details = usage.get(key)
    if details is None:
        return {}
    if not isinstance(details, Mapping):
        raise InvalidUsage(f"{key} is not a map")
    return details


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
    def from_map(cls, usage: Mapping[str, Any] | None) -> Usage:
        """The counts of a Responses ``usage`` map (zeros for what is absent or malformed)."""
        if not isinstance(usage, Mapping):
            return cls()
        inp = usage.get("input_tokens_details")
        out = usage.get("output_tokens_details")
        inp = inp if isinstance(inp, Mapping) else {}
        out = out if isinstance(out, Mapping) else {}
        return cls(
            input_tokens=count_or_zero(usage.get("input_tokens")),
            cached_tokens=count_or_zero(inp.get("cached_tokens")),
            cache_write_tokens=count_or_zero(inp.get("cache_write_tokens")),
            output_tokens=count_or_zero(usage.get("output_tokens")),
            reasoning_tokens=count_or_zero(out.get("reasoning_tokens")),
        )

    @classmethod
    def from_wire(cls, usage: Any) -> Usage:
        """A worker's report, read strictly (``InvalidUsage`` says what cannot be true).

        Absent counts are 0 (the gateway fills in the complete shape); ``total_tokens``, where
        sent, must be a count but is not trusted: it is always ``input + output``. Keys a newer
        peer adds are ignored.
        """
        if not isinstance(usage, Mapping):
            raise InvalidUsage("usage is not a map")
        inp, out = _details(usage, "input_tokens_details"), _details(usage, "output_tokens_details")
        _wire_count(usage, "total_tokens")
        made = cls(
            input_tokens=_wire_count(usage, "input_tokens"),
            cached_tokens=_wire_count(inp, "cached_tokens", "input_tokens_details."),
            cache_write_tokens=_wire_count(inp, "cache_write_tokens", "input_tokens_details."),
            output_tokens=_wire_count(usage, "output_tokens"),
            reasoning_tokens=_wire_count(out, "reasoning_tokens", "output_tokens_details."),
        )
        if max(made.cached_tokens, made.cache_write_tokens) > made.input_tokens:
            raise InvalidUsage("input_tokens_details counts more than input_tokens")
        if made.reasoning_tokens > made.output_tokens:
            raise InvalidUsage("output_tokens_details.reasoning_tokens is more than output_tokens")
        return made

    def to_wire(self) -> dict[str, Any]:
        return self.to_map()

    def to_map(self) -> dict[str, Any]:
        """The Responses ``usage`` object, every required field present."""
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": self.cache_write_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.total_tokens,
        }

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.cached_tokens + other.cached_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
            self.output_tokens + other.output_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
        )
