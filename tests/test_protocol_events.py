"""protocol/events.py describes what the worker really sends: one constant per TypedDict of the
``WorkerEvent`` union, every event the worker's assembler emits has exactly its TypedDict's keys,
and the narrowing guards stay tolerant of a hostile map (no type, no KeyError)."""

from __future__ import annotations

import typing
from typing import Any

from kiln.protocol import events as ev
from kiln.worker.output.events import Call, OutputAssembler, Piece, logprob_entry

CONSTANTS = {name: value for name, value in vars(ev).items() if name.isupper() and isinstance(value, str)}
MEMBERS = typing.get_args(ev.WorkerEvent)


def _type_of(member: Any) -> str:
    (literal,) = typing.get_args(typing.get_type_hints(member)["type"])
    return str(literal)


def test_one_constant_per_event_shape() -> None:
    assert sorted(CONSTANTS.values()) == sorted(_type_of(m) for m in MEMBERS)
    assert len(set(CONSTANTS.values())) == len(CONSTANTS)


class _Script:
    """A router that turns each token's text into the pieces named by it."""

    PIECES = {
        "r": [Piece("reasoning", "thinking")],
        "c": [Piece("content", "Hello")],
        "s": [Piece("call_start", index=0, name="lookup")],
        "a": [Piece("call_args", '{"q": ', index=0)],
    }

    def feed(self, text: str) -> list[Piece]:
        return list(self.PIECES.get(text, []))

    def finish(self) -> tuple[list[Piece], list[Call]]:
        return [], [Call("lookup", '{"q": 1}')]


def _emitted() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    assembler = OutputAssembler(lambda e: out.append(dict(e)), router=_Script(), want_logprobs=True)
    for text in ("r", "c", "s", "a"):
        assembler.add_token(text, logprob_entry(text, -0.5, [(text, -0.5), ("x", -2.0)]))
    assembler.finish("stop")
    return out


def test_the_worker_emits_exactly_the_typed_shapes() -> None:
    shapes = {_type_of(m): m for m in MEMBERS}
    emitted = _emitted()
    assert {e["type"] for e in emitted} == set(shapes)  # the script reaches every kind
    for event in emitted:
        assert set(event) == shapes[event["type"]].__required_keys__, event["type"]
        for part in [event["part"]] if "part" in event else []:
            assert set(part) == ev.OutputTextPart.__required_keys__
        for entry in event.get("logprobs") or []:
            assert set(entry) == ev.Logprob.__required_keys__
            assert all(set(top) == ev.TopLogprob.__required_keys__ for top in entry["top_logprobs"])


def test_guards_read_the_type_tolerantly() -> None:
    guards = (ev.is_item_added, ev.is_item_done, ev.is_text_delta, ev.is_reasoning_delta, ev.is_arguments_delta)
    for hostile in ({}, {"type": None}, {"type": 3}, {"delta": "x"}):
        assert not any(guard(hostile) for guard in guards)
    assert ev.is_text_delta({"type": ev.OUTPUT_TEXT_DELTA})
    assert ev.is_arguments_delta({"type": ev.FUNCTION_CALL_ARGUMENTS_DELTA})
