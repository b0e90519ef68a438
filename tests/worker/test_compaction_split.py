"""Compaction split points, property-based over generated histories: a call never loses its
output, the latest user message is always kept, and keep_tokens is honoured."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.protocol.request import ContentPart, FunctionCall, FunctionCallOutput, Message
from kiln.worker.compaction import plan


def typed(item: dict):
    """The item as the worker receives it (kiln.protocol.request)."""
    if item["type"] == "message":
        return Message(item["role"], (ContentPart("input_text", item["content"]),))
    if item["type"] == "function_call":
        return FunctionCall(item["call_id"], item["name"], item["arguments"])
    return FunctionCallOutput(item["call_id"], item["output"])


def typed_size(items):
    """``size`` of the typed items: the same count."""
    return sum(len(i.text if isinstance(i, Message) else getattr(i, "output", "")) + 5 for i in items)


@st.composite
def histories(draw):
    items = []
    if draw(st.booleans()):
        items.append({"type": "message", "role": "system", "content": "sys"})
    turns = draw(st.integers(1, 8))
    call = 0
    for _ in range(turns):
        items.append({"type": "message", "role": "user", "content": "u" * draw(st.integers(1, 40))})
        for _ in range(draw(st.integers(0, 3))):
            calls = draw(st.integers(1, 3))
            ids = [f"c{call + i}" for i in range(calls)]
            call += calls
            items += [{"type": "function_call", "call_id": c, "name": "f", "arguments": "{}"} for c in ids]
            items += [{"type": "function_call_output", "call_id": c, "output": "o" * draw(st.integers(1, 30))} for c in ids]
        if draw(st.booleans()):
            items.append({"type": "message", "role": "assistant", "content": "a" * draw(st.integers(1, 40))})
    return items


def size(items):
    return sum(len(str(i.get("content") or i.get("output") or "")) + 5 for i in items)


@settings(max_examples=300, deadline=None)
@given(histories(), st.integers(1, 400))
def test_split_keeps_calls_with_outputs(items, keep):
    p = plan([typed(i) for i in items], keep, typed_size)
    if not p.summarized:
        users = [i for i in items if i.get("role") == "user"]
        assert len(users) == 1  # nothing to summarize only when nothing precedes the latest user message
        assert [items[i] for i in p.retained] == [i for i in items if i.get("role") != "system"]
        return
    retained = [items[i] for i in p.retained]
    summarized = [items[i] for i in p.summarized]
    assert p.summarized and p.retained
    latest_user = max(i for i, it in enumerate(items) if it.get("role") == "user")
    assert latest_user in p.retained
    kept_calls = {i["call_id"] for i in retained if i["type"] == "function_call"}
    kept_outputs = {i["call_id"] for i in retained if i["type"] == "function_call_output"}
    assert kept_calls == kept_outputs
    gone_calls = {i["call_id"] for i in summarized if i["type"] == "function_call"}
    gone_outputs = {i["call_id"] for i in summarized if i["type"] == "function_call_output"}
    assert gone_calls == gone_outputs
    first = min(p.retained)
    if first != latest_user:  # extended beyond the latest turn only while it fits
        assert size(retained) <= keep
    assert all(items[i].get("role") in ("system", "developer") for i in p.kept)


# -- the summary's budget (issue 15): bounded by what is summarized, one tighter retry ----------
from kiln.worker.compaction import retry_budget, summary_budget  # noqa: E402


@given(st.integers(1, 100_000), st.integers(0, 200), st.integers(1, 16384))
def test_summary_budget_is_bounded_by_what_it_replaces(summarized, framing, max_out):
    budget = summary_budget(summarized, framing, max_out)
    assert 1 <= budget <= max_out
    if summarized - framing >= 2:
        # A summary of at most ``budget`` tokens plus its framing is shorter than the turns.
        assert framing + budget < summarized


@given(st.integers(1, 16384), st.integers(0, 16384), st.integers(0, 16384))
def test_retry_budget_is_tighter_or_none(budget, produced, excess):
    tighter = retry_budget(budget, produced, excess)
    if tighter is not None:
        assert 1 <= tighter <= budget // 2
        assert tighter < produced - excess
