"""Automatic compaction (``context_management``) with the bundled model, through real processes.

The rules are tested one by one with the scripted engine (tests/gateway/test_compaction_scripted.py);
here the summary is the real model's, and a long conversation must keep working inside
SmolLM2's 8192-token window however many turns it runs.
"""

from __future__ import annotations

import pytest

from tests.conformance import assert_stream
from tests.support import stream

MODEL = "smollm2-135m-instruct"
WINDOW = 8192
CITIES = ["Oslo", "Lima", "Hanoi", "Dakar", "Quito", "Perth", "Turin", "Cusco", "Riga", "Accra"]


def user_turn(n: int, long: bool = False) -> str:
    """About 110 tokens (``long``: about 210) of facts a user might want remembered."""
    city = CITIES[n % len(CITIES)]
    text = (
        f"Turn {n}. Please note the delivery plan for {city}: parcel {n} weighs {n + 3} kg, "
        f"leaves the depot at {6 + n % 12}:15, travels by {'rail' if n % 2 else 'road'}, and must "
        f"be signed for by the site manager, whose badge number is {1000 + 37 * n}. The customer "
        f"asked for a call {n % 5 + 1} hours before arrival, a spare pallet, and a copy of the "
        f"invoice in the box."
    )
    if long:
        text += (
            f" The loading bay at {city} closes at {14 + n % 6}:00 on weekdays, so the driver must "
            f"phone the gate on extension {200 + n} when the truck is twenty minutes away. Parcel "
            f"{n} holds {n % 7 + 2} boxes of spare parts and one crate of glassware marked fragile; "
            f"the crate must stay upright and travel on the top shelf, away from the doors."
        )
    return text + " Reply with a one-line confirmation of the weight and the city."


def turn(http, n: int, previous: str | None, threshold: int, long: bool = False) -> tuple[dict, list[dict], list[str]]:
    body = {
        "model": MODEL,
        "input": [{"role": "user", "content": user_turn(n, long)}],
        "max_output_tokens": 40,
        "temperature": 0,
        "context_management": [{"type": "compaction", "compact_threshold": threshold}],
    }
    if previous:
        body["previous_response_id"] = previous
    names, events = stream(http, body)
    assert_stream(events, names)
    return events[-1]["response"], events, names


def compaction_events_in_order(events: list[dict]) -> tuple[dict, dict]:
    types = [e["type"] for e in events]
    started, completed = types.index("mlx.compaction.started"), types.index("mlx.compaction.completed")
    added = next(i for i, e in enumerate(events) if e["type"] == "response.output_item.added")
    assert types.index("response.in_progress") < started < completed < added
    assert events[added]["output_index"] == 0 and events[added]["item"]["type"] == "compaction"
    return events[started], events[completed]


def test_auto_compaction_at_the_threshold_then_chains_without_compacting_again(http):
    previous = None
    for n in range(1, 5):  # ~4 x 170 tokens of history
        response, _, _ = turn(http, n, previous, threshold=100_000)
        previous = response["id"]
    response, events, _ = turn(http, 5, previous, threshold=600)
    assert response["status"] in ("completed", "incomplete"), response
    started, completed = compaction_events_in_order(events)
    assert started["input_tokens"] >= 600
    assert completed["input_tokens_before"] == started["input_tokens"]
    assert completed["input_tokens_after"] < completed["input_tokens_before"]
    assert response["output"][0]["type"] == "compaction"
    assert response["usage"]["input_tokens"] < started["input_tokens"]
    # The next hop replays the summary and, below the threshold again, does not compact.
    follow, events, _ = turn(http, 6, response["id"], threshold=completed["input_tokens_after"] + 400)
    assert not any(e["type"].startswith("mlx.compaction") for e in events)
    assert follow["output"][0]["type"] != "compaction"
    assert follow["usage"]["input_tokens"] < started["input_tokens"] + 200


@pytest.mark.slow
def test_forty_turns_stay_inside_the_window(http):
    """Each turn adds ~250 tokens: without compaction the history would outgrow the 8192-token
    window around turn 33. With a threshold of 5000 it is compacted whenever it gets there."""
    previous, rows = None, []
    for n in range(1, 41):
        response, events, _ = turn(http, n, previous, threshold=5000, long=True)
        assert response["status"] in ("completed", "incomplete"), (n, response.get("error"))
        usage = response["usage"]
        before = after = None
        if any(e["type"] == "mlx.compaction.started" for e in events):
            _, completed = compaction_events_in_order(events)
            before, after = completed["input_tokens_before"], completed["input_tokens_after"]
        rows.append((n, before, after, usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"]))
        assert usage["input_tokens"] + usage["output_tokens"] <= WINDOW
        previous = response["id"]
    print("\nturn  compacted: before -> after  input_tokens  cached  output")
    for n, before, after, inp, cached, out in rows:
        moved = f"{before:>6} -> {after:<6}" if before else " " * 16
        print(f"{n:>4}  {moved:>26}  {inp:>12}  {cached:>6}  {out:>6}")
    assert sum(1 for r in rows if r[1]) >= 2, "expected at least two compactions in 40 turns"
