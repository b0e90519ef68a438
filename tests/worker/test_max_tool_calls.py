"""``max_tool_calls`` (issue 15, point 0): calls past the limit are never emitted, neither their
streamed events nor their final items."""

from __future__ import annotations

from kiln.worker.output.events import Call, OutputAssembler, Piece


class ThreeCalls:
    """A router that sees three tool calls in the generated text."""

    def feed(self, text: str) -> list[Piece]:
        return [Piece("call_start", index=i, name=f"f{i}") for i in range(3)] + [Piece("call_args", "{}", index=i) for i in range(3)]

    def finish(self) -> tuple[list[Piece], list[Call]]:
        return [], [Call(f"f{i}", "{}") for i in range(3)]


def _run(limit: int | None) -> list[dict]:
    events: list[dict] = []
    assembler = OutputAssembler(events.append, router=ThreeCalls(), max_tool_calls=limit)
    assembler.add_token("x")
    assembler.finish("stop")
    return events


def test_calls_beyond_the_limit_are_not_emitted():
    events = _run(2)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["name"] for i in done] == ["f0", "f1"]
    assert {e["output_index"] for e in events if "output_index" in e} == {0, 1}


def test_without_a_limit_every_call_is_emitted():
    done = [e["item"] for e in _run(None) if e["type"] == "response.output_item.done"]
    assert [i["name"] for i in done] == ["f0", "f1", "f2"]
