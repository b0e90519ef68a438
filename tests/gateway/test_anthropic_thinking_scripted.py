"""Thinking blocks through real processes with the scripted engine (named as such) replaying a
reasoning model's text, driven by the anthropic SDK: streamed and not; a thinking block handed
back with Kiln's signature or another server's is accepted, a tampered Kiln signature is refused;
``thinking: disabled`` leaves the blocks out."""

from __future__ import annotations

import anthropic
import pytest

from tests.support import Kiln

MODEL = "kiln-scripted"
THINKING = "<think>The user greets me.</think>Hello there!"


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    s = Kiln(tmp_path_factory.mktemp("anthropic-think"), worker_args=["--engine", "scripted", "--scripted-reply", THINKING]).start(timeout=60)
    yield anthropic.Anthropic(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
    s.stop()


def test_thinking_then_text_streamed_and_not(thinking):
    ask = {"model": MODEL, "max_tokens": 200, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 1024}}
    m = thinking.messages.create(**ask)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "The user greets me." and m.content[0].signature
    assert m.content[1].text == "Hello there!" and m.stop_reason == "end_turn"
    with thinking.messages.stream(**ask) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "thinking" in kinds and "signature" in kinds
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content]


def test_signature_round_trip_and_disabled(thinking):
    first = thinking.messages.create(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "hi"}])
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": "and again"},
    ]
    assert thinking.messages.create(model=MODEL, max_tokens=20, messages=history).content  # Kiln's own signature
    foreign = [dict(history[1]["content"][0], signature="another-servers-signature")] + history[1]["content"][1:]
    assert thinking.messages.create(model=MODEL, max_tokens=20, messages=[history[0], {"role": "assistant", "content": foreign}, history[2]]).content
    tampered = [dict(history[1]["content"][0], signature=history[1]["content"][0]["signature"][:-4] + "AAAA")] + history[1]["content"][1:]
    with pytest.raises(anthropic.BadRequestError):
        thinking.messages.create(model=MODEL, max_tokens=20, messages=[history[0], {"role": "assistant", "content": tampered}, history[2]])
    hidden = thinking.messages.create(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "hi"}], thinking={"type": "disabled"})
    assert [b.type for b in hidden.content] == ["text"] and hidden.content[0].text == "Hello there!"


def test_a_prompt_over_the_window_is_an_http_400_streamed_or_not(thinking):
    """The worker refuses it before its first token: the stream has not opened, so the client gets
    the status (as Anthropic answers), not a 200 with an error event."""
    too_long = [{"role": "user", "content": "x" * 9000}]  # one byte a token; the window is 8192
    with pytest.raises(anthropic.BadRequestError) as err:
        thinking.messages.create(model=MODEL, max_tokens=20, messages=too_long)
    assert err.value.body["error"]["type"] == "invalid_request_error" and "context window" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError), thinking.messages.stream(model=MODEL, max_tokens=20, messages=too_long) as s:
        s.get_final_message()
    assert thinking.messages.create(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "hi"}]).content  # nothing leaked
