"""kiln.protocol.usage.Usage: the one usage value of worker, gateway, ledger and metrics."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kiln.protocol.usage import Usage

counts = st.integers(min_value=0, max_value=1 << 40)


@given(counts, counts, counts, counts)
def test_round_trip_and_sum(inp, cached, out, reasoning):
    usage = Usage(input_tokens=inp, cached_tokens=cached, output_tokens=out, reasoning_tokens=reasoning)
    assert Usage.from_map(usage.to_map()) == usage
    assert usage.to_map()["total_tokens"] == inp + out
    assert (usage + usage).to_map()["output_tokens"] == 2 * out


def test_malformed_counts_read_as_zero():
    """A peer's odd map never breaks a bill: absent, negative, float, bool or nested-wrong counts are 0."""
    odd = {"input_tokens": -5, "output_tokens": 2.5, "input_tokens_details": ["x"], "output_tokens_details": {"reasoning_tokens": True}}
    assert Usage.from_map(odd) == Usage()
    assert Usage.from_map(None) == Usage()
    assert Usage.from_map({"input_tokens": 7}).to_map() == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 7,
    }
