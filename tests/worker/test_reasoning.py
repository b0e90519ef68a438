"""Reasoning splitter: recorded outputs and any-split invariance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.worker.output.reasoning import ReasoningSplitter, prompt_opens_reasoning


def run(chunks: list[str], **kwargs: object) -> tuple[str, str, list[tuple[str, str]]]:
    splitter = ReasoningSplitter(**kwargs)  # type: ignore[arg-type]
    pieces: list[tuple[str, str]] = []
    for chunk in chunks:
        pieces += splitter.feed(chunk)
    pieces += splitter.finish()
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    content = "".join(t for k, t in pieces if k == "content")
    return reasoning, content, pieces


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=False)]


# (text, start_in_reasoning, expected reasoning, expected content)
SAMPLES: list[tuple[str, bool, str, str]] = [
    ("<think>\nThe user wants 2+2.\nIt is 4.\n</think>\n\nThe answer is **4**.", False, "The user wants 2+2.\nIt is 4.", "The answer is **4**."),
    ("\n\n  <think>Überlegung 🤔 </think>Antwort", False, "Überlegung 🤔", "Antwort"),
    ("Let me think: x < y </thin and <think> here is content.", True, "Let me think: x < y </thin and <think> here is content.", ""),
    ("Okay, so 3*3 is 9.\n</think>\n\n9 <think>not reasoning</think>", True, "Okay, so 3*3 is 9.", "9 <think>not reasoning</think>"),
    ("Plain answer with <thinking> words and </think> tags.", False, "", "Plain answer with <thinking> words and </think> tags."),
    ("  <thin", False, "", "  <thin"),
    ("<think></think>Direct.", False, "", "Direct."),
    ("<think>\nstill thinking when cut off <\\", False, "still thinking when cut off <\\", ""),
    ("\n<think>\n</think>\n\n", True, "", ""),  # the prompt opened it; a repeated tag is dropped
    ("<thi", True, "<thi", ""),
]


@pytest.mark.parametrize("text,start,want_reasoning,want_content", SAMPLES)
def test_recorded(text: str, start: bool, want_reasoning: str, want_content: str) -> None:
    reasoning, content, pieces = run([text], start_in_reasoning=start)
    assert (reasoning, content) == (want_reasoning, want_content)
    assert all(t for _, t in pieces)


@settings(max_examples=300, deadline=None)
@given(
    sample=st.sampled_from(SAMPLES),
    cuts=st.lists(st.integers(min_value=1, max_value=120), max_size=30),
)
def test_any_split_equals_whole(sample: tuple[str, bool, str, str], cuts: list[int]) -> None:
    text, start, want_reasoning, want_content = sample
    reasoning, content, _ = run(split(text, cuts), start_in_reasoning=start)
    assert (reasoning, content) == (want_reasoning, want_content)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("<>/thinkab \n")), max_size=40),
    start=st.booleans(),
    cuts=st.lists(st.integers(min_value=1, max_value=40), max_size=12),
)
def test_random_text_any_split(text: str, start: bool, cuts: list[int]) -> None:
    assert run(split(text, cuts), start_in_reasoning=start)[:2] == run([text], start_in_reasoning=start)[:2]


def test_reasoning_streams_before_close() -> None:
    splitter = ReasoningSplitter(start_in_reasoning=True)
    assert splitter.feed("Hmm, ") == [("reasoning", "Hmm,")]
    assert splitter.feed("let me see</th") == [("reasoning", " let me see")]
    assert splitter.in_reasoning
    assert splitter.feed("ink>\n\nYes.") == [("content", "Yes.")]
    assert not splitter.in_reasoning
    assert splitter.finish() == []


def test_custom_tags() -> None:
    reasoning, content, _ = run(["◁think▷plan◁/think▷done"], open_tag="◁think▷", close_tag="◁/think▷")
    assert (reasoning, content) == ("plan", "done")


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
