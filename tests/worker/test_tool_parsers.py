"""Incremental tool-call parsers: recorded model-like outputs, split every which way.

The core property: however the generated text is cut into deltas, the
streamed text, call names and concatenated argument fragments are the same as
when it is fed whole, and agree with the authoritative ``finish()``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.worker.output.tool_calls.base import (
    ArgumentsDelta,
    CallStarted,
    CutCall,
    FinalParse,
    TextDelta,
    ToolCallParser,
)
from kiln.worker.output.tool_calls.end_only import EndOnlyParser
from kiln.worker.output.tool_calls.hermes import HermesParser
from kiln.worker.output.tool_calls.llama3 import Llama3Parser
from kiln.worker.output.tool_calls.mistral import MistralParser
from kiln.worker.output.tool_calls.qwen3_coder import Qwen3CoderParser
from kiln.worker.output.tool_calls.select import format_for_template, parser_for

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
    {
        "type": "function",
        "name": "run",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {
                "cmd": {"type": "string"},
                "timeout": {"type": "number"},
                "env": {"type": "object"},
                "args": {"type": "array"},
                "dry": {"type": "boolean"},
                "note": {"type": ["string", "null"]},
            },
        },
    },
]

MARKUP = ("<tool_call", "</tool_call", "[TOOL_CALLS]", "[ARGS]", "<function=", "<parameter=", "<|python_tag|>")


@dataclass
class Run:
    """What a consumer sees from one generation."""

    text: str = ""
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)
    final: FinalParse | None = None


def feed_chunks(parser: ToolCallParser, chunks: list[str]) -> Run:
    run = Run()
    for chunk in chunks:
        for event in parser.feed(chunk):
            if isinstance(event, TextDelta):
                run.text += event.text
            elif isinstance(event, CallStarted):
                assert event.index == len(run.names)
                run.names.append(event.name)
                run.arguments.append("")
            else:
                assert isinstance(event, ArgumentsDelta)
                assert event.index == len(run.names) - 1
                run.arguments[event.index] += event.delta
    run.final = parser.finish()
    return run


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=False)]


Expected = tuple[str, list[tuple[str, dict[str, Any]]]]

HERMES: list[tuple[str, Expected]] = [
    (
        'Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n</tool_call>',
        ("Let me check the weather.", [("get_weather", {"city": "Zürich", "days": 3})]),
    ),
    (
        '<tool_call>\n{"name": "run", "arguments": {"cmd": "echo \\"}\\" </tool_call>", "env": {"A": {"b": [1, {"c": null}]}}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京 🌸"}}\n</tool_call>\n',
        ("", [
            ("run", {"cmd": 'echo "}" </tool_call>', "env": {"A": {"b": [1, {"c": None}]}}}),
            ("get_weather", {"city": "東京 🌸"}),
        ]),
    ),
    (  # keys in the other order: parsed whole, still a call
        'Sure.<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call> Done <b>.',
        ("Sure. Done <b>.", [("get_weather", {"city": "Oslo"})]),
    ),
    (  # arguments as a JSON string; two objects in one block
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n{"name": "run", "arguments": {}}</tool_call>',
        ("", [("get_weather", {"city": "Rome"}), ("run", {})]),
    ),
    (  # a missing final brace and no close tag are forgiven once the arguments are complete
        'ok <tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}</tool_call>',
        ("ok", [("get_weather", {"city": "Lima"})]),
    ),
    ('No tools needed: 1 < 2 and <b>bold</b> <tool', ("No tools needed: 1 < 2 and <b>bold</b> <tool", [])),
    (  # a block that is not a call is the model's text, in place
        '<tool_call>not json</tool_call> then <tool_call>{"name": "run", "arguments": {"cmd": "x"}}</tool_call>',
        ("<tool_call>not json</tool_call> then", [("run", {"cmd": "x"})]),
    ),
]

MISTRAL: list[tuple[str, Expected]] = [
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
        ("", [("get_weather", {"city": "Paris", "days": 2})]),
    ),
    (
        'Checking both.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]run[ARGS]{"cmd": "ls [ARGS] {x}", "env": {"K": ["v", {"n": 1}]}}',
        ("Checking both.", [
            ("get_weather", {"city": "Zürich"}),
            ("run", {"cmd": "ls [ARGS] {x}", "env": {"K": ["v", {"n": 1}]}}),
        ]),
    ),
    (  # v11 repeats headers without the marker; [CALL_ID] is skipped
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Bern"}run[ARGS]{}',
        ("", [("get_weather", {"city": "Bern"}), ("run", {})]),
    ),
    (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "🌍"}, "id": "abc123xyz"}, {"name": "run", "arguments": {"cmd": "x"}}]',
        ("", [("get_weather", {"city": "🌍"}), ("run", {"cmd": "x"})]),
    ),
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}\n\nAnything else?',
        ("Anything else?", [("get_weather", {"city": "Rome"})]),
    ),
    ("Arrays like [1, 2] and [TOOL are fine.", ("Arrays like [1, 2] and [TOOL are fine.", [])),
]

LLAMA3: list[tuple[str, Expected]] = [
    (
        '{"name": "get_weather", "parameters": {"city": "San José", "days": 1}}',
        ("", [("get_weather", {"city": "San José", "days": 1})]),
    ),
    (
        '<|python_tag|>{"type": "function", "name": "run", "parameters": {"cmd": "a;b", "env": {"x": {"y": []}}}}; {"name": "get_weather", "parameters": {"city": "Kyiv"}}',
        ("", [("run", {"cmd": "a;b", "env": {"x": {"y": []}}}), ("get_weather", {"city": "Kyiv"})]),
    ),
    (
        'I will look it up.<|python_tag|>{"name": "get_weather", "arguments": {"city": "Nairobi"}}',
        ("I will look it up.", [("get_weather", {"city": "Nairobi"})]),
    ),
    ('{"answer": 42, "note": "plain JSON is text"}', ('{"answer": 42, "note": "plain JSON is text"}', [])),
    ('The JSON {"name": "x", "parameters": {}} mid-text is text.', ('The JSON {"name": "x", "parameters": {}} mid-text is text.', [])),
]

QWEN3_CODER: list[tuple[str, Expected]] = [
    (
        "I'll run it.\n<tool_call>\n<function=run>\n<parameter=cmd>\nprintf \"a\\tb\" | grep '<x>'\n\n</parameter>\n"
        "<parameter=timeout>\n2.5\n</parameter>\n<parameter=env>\n{\"HOME\": {\"nested\": [1, 2]}}\n</parameter>\n"
        "<parameter=dry>\ntrue\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>",
        ("I'll run it.", [
            ("run", {"cmd": "printf \"a\\tb\" | grep '<x>'\n", "timeout": 2.5, "env": {"HOME": {"nested": [1, 2]}}, "dry": True, "note": None}),
        ]),
    ),
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nMünchen\n</parameter>\n<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n北京 \"q\" \\ </par\n\n</parameter>\n</function>\n</tool_call>",
        ("", [("get_weather", {"city": "München", "days": 4}), ("get_weather", {"city": '北京 "q" \\ </par\n'})]),
    ),
    (  # no </parameter> before the next parameter; no <tool_call> wrapper; unknown parameter stays a string
        "<function=run>\n<parameter=cmd>\nls\n<parameter=args>\n[\"-l\", 2]\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\nDone.",
        ("Done.", [("run", {"cmd": "ls", "args": ["-l", 2], "extra": "7"})]),
    ),
    ("Compare a <b> tag and <tool_ca", ("Compare a <b> tag and <tool_ca", [])),
]

PYTHONIC: list[tuple[str, Expected]] = [
    ('[get_weather(city="Paris", days=2), run(cmd="ls")]', ("", [("get_weather", {"city": "Paris", "days": 2}), ("run", {"cmd": "ls"})])),
    (
        'Calling.<|tool_call_start|>[get_weather(city="Zürich")]<|tool_call_end|> Done.',
        ("Calling. Done.", [("get_weather", {"city": "Zürich"})]),
    ),
    ("[1, 2] is a list.", ("[1, 2] is a list.", [])),
]

FORMATS: dict[str, tuple[Callable[[], ToolCallParser], list[tuple[str, Expected]]]] = {
    "hermes": (lambda: HermesParser(TOOLS), HERMES),
    "mistral": (lambda: MistralParser(TOOLS), MISTRAL),
    "llama3": (lambda: Llama3Parser(TOOLS), LLAMA3),
    "qwen3_coder": (lambda: Qwen3CoderParser(TOOLS), QWEN3_CODER),
    "pythonic": (lambda: EndOnlyParser("pythonic", TOOLS), PYTHONIC),
}

CASES = [(fmt, i) for fmt, (_, samples) in FORMATS.items() for i in range(len(samples))]


def check_consistent(run: Run, streams: bool) -> None:
    final = run.final
    assert final is not None
    assert final.text.startswith(run.text)
    if streams:
        # Only a call cut off at the very end may have started without a final parse.
        assert [c.name for c in final.calls] == run.names[: len(final.calls)]
        assert len(run.names) - len(final.calls) in (0, 1)
        for streamed, call in zip(run.arguments, final.calls, strict=False):
            assert call.arguments.startswith(streamed)
    else:
        assert run.names == [] and run.arguments == []
    for call in final.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("fmt,i", CASES)
def test_recorded_outputs_whole(fmt: str, i: int) -> None:
    factory, samples = FORMATS[fmt]
    text, (want_text, want_calls) = samples[i]
    run = feed_chunks(factory(), [text])
    assert run.final is not None
    assert run.final.text == want_text
    assert [(c.name, json.loads(c.arguments)) for c in run.final.calls] == want_calls
    check_consistent(run, factory().streams_arguments)
    if factory().streams_arguments:
        assert run.arguments == [c.arguments for c in run.final.calls]
        if want_calls:  # without calls the end may be held-back partial markup, sent by finish
            assert run.text == run.final.text
    if want_calls and not any(m in want_text for m in MARKUP):
        assert not any(m in run.text for m in MARKUP)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=40))
def test_any_split_equals_whole(case: tuple[str, int], cuts: list[int]) -> None:
    fmt, i = case
    factory, samples = FORMATS[fmt]
    text = samples[i][0]
    whole = feed_chunks(factory(), [text])
    pieces = feed_chunks(factory(), split(text, cuts))
    assert pieces.text == whole.text
    assert pieces.names == whole.names
    assert pieces.arguments == whole.arguments
    assert pieces.final == whole.final
    check_consistent(pieces, factory().streams_arguments)


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), cut=st.integers(min_value=0, max_value=400), data=st.data())
def test_cut_off_generation_is_consistent(case: tuple[str, int], cut: int, data: st.DataObject) -> None:
    """A generation stopped anywhere (max_output_tokens) still parses consistently."""
    fmt, i = case
    factory, samples = FORMATS[fmt]
    text = samples[i][0]
    text = text[: cut % (len(text) + 1)]
    cuts = data.draw(st.lists(st.integers(min_value=1, max_value=max(1, len(text))), max_size=20))
    whole = feed_chunks(factory(), [text])
    pieces = feed_chunks(factory(), split(text, cuts))
    assert pieces.text == whole.text and pieces.final == whole.final
    assert pieces.names == whole.names and pieces.arguments == whole.arguments
    check_consistent(pieces, factory().streams_arguments)


def test_char_by_char_emits_args_while_generated() -> None:
    text = '<tool_call>\n{"name": "run", "arguments": {"cmd": "a long command"}}\n</tool_call>'
    parser = HermesParser(TOOLS)
    seen_before_close = 0
    for pos, ch in enumerate(text):
        for event in parser.feed(ch):
            if isinstance(event, ArgumentsDelta) and pos < text.index("</tool_call>"):
                seen_before_close += 1
    assert seen_before_close > 5


def test_partial_marker_is_held_then_released() -> None:
    parser = HermesParser(TOOLS)
    assert parser.feed("Hi <tool_") == [TextDelta("Hi")]
    assert parser.feed("box>") == [TextDelta(" <tool_box>")]


def test_call_cut_off_at_end_is_a_cut_call_not_text() -> None:
    """max_output_tokens ended the text inside a call: what was read of it is ``cut``, and no
    markup is text."""
    text = 'Plan: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    run = feed_chunks(HermesParser(TOOLS), [text[:10], text[10:]])
    assert run.text == "Plan:"
    assert run.final == FinalParse(text="Plan:", calls=[], cut=CutCall("get_weather", '{"city": "Par'))
    assert run.names == ["get_weather"]  # it was started; the final parse reports it cut
    assert run.arguments == ['{"city": "Par']


@pytest.mark.parametrize("end", ["<tool_call>", "<tool_call>\n", '<tool_call>\n{"name', '<tool_call>\n{"name": "get_weather", "argu'])
def test_call_cut_before_its_arguments_is_nameless_cut(end: str) -> None:
    run = feed_chunks(HermesParser(TOOLS), [end])
    assert run.final == FinalParse(text="", calls=[], cut=CutCall(None, "")) and run.text == ""


def test_malformed_closed_block_is_text_and_later_calls_survive() -> None:
    text = "<tool_call>not json</tool_call> then <tool_call>{\"name\": \"run\", \"arguments\": {}}</tool_call>"
    run = feed_chunks(HermesParser(TOOLS), [text])
    assert run.final is not None
    assert run.final.text == "<tool_call>not json</tool_call> then"
    assert [c.name for c in run.final.calls] == ["run"]
    assert run.text == run.final.text


def test_mistral_cut_in_arguments_is_text() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'
    run = feed_chunks(MistralParser(TOOLS), [text])
    assert run.final == FinalParse(text=text, calls=[])


def test_qwen3_coder_matches_mlx_lm_final_parse() -> None:
    from mlx_lm.tool_parsers import qwen3_coder as mlx_qwen3_coder

    from kiln.worker.output.tool_calls.base import nested_tools

    text = QWEN3_CODER[1][0]
    block = text.split("<tool_call>")[1].split("</tool_call>")[0].strip()
    theirs = mlx_qwen3_coder.parse_tool_call(block, nested_tools(TOOLS))
    ours = feed_chunks(Qwen3CoderParser(TOOLS), [text]).final
    assert ours is not None
    assert (ours.calls[0].name, json.loads(ours.calls[0].arguments)) == (theirs["name"], theirs["arguments"])


def test_qwen3_coder_without_schemas_keeps_strings() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    run = feed_chunks(Qwen3CoderParser(None), list(text))
    assert run.final is not None and json.loads(run.final.calls[0].arguments) == {"n": "5"}
    assert run.arguments == [run.final.calls[0].arguments]


@pytest.mark.parametrize(
    "fmt,text,want",
    [
        ("gemma4", "Hm.<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>", ("Hm.", [("get_weather", {"city": "Paris"})])),
        ("function_gemma", "<start_function_call>call:get_weather{city:<escape>Rome<escape>}<end_function_call>", ("", [("get_weather", {"city": "Rome"})])),
        (
            "kimi_k2",
            'x<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>',
            ("x", [("get_weather", {"city": "Oslo"})]),
        ),
        ("gemma4", "Broken <|tool_call>call:get_weather{city:<tool_call|> tail", ("Broken <|tool_call>call:get_weather{city:<tool_call|> tail", [])),
    ],
)
def test_end_only_formats(fmt: str, text: str, want: Expected) -> None:
    for chunks in ([text], list(text)):
        parser = EndOnlyParser(fmt, TOOLS)
        run = feed_chunks(parser, chunks)
        assert run.final is not None
        assert (run.final.text, [(c.name, json.loads(c.arguments)) for c in run.final.calls]) == want
        assert run.names == [] and run.final.text.startswith(run.text)
        if want[1]:
            assert "<" not in run.text


SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template,fmt,cls",
    [
        (None, "hermes", HermesParser),
        (SMOLLM2_TEMPLATE, "hermes", HermesParser),
        ("{% if tools %}...<tool_call>\\n{{ tool_call.name }}...</tool_call>{% endif %}", "hermes", HermesParser),
        ("{{- '[TOOL_CALLS]' + tool_call.name + '[ARGS]' }}", "mistral", MistralParser),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3", Llama3Parser),
        ("<tool_call>\\n<function={{ name }}>\\n<parameter={{ k }}>", "qwen3_coder", Qwen3CoderParser),
        ("<|tool_call_start|>[{{ calls }}]<|tool_call_end|>", "pythonic", EndOnlyParser),
        ("<|tool_call>call:{{ n }}<tool_call|>", "gemma4", EndOnlyParser),
    ],
)
def test_parser_for_template(template: str | None, fmt: str, cls: type) -> None:
    assert format_for_template(template) == fmt
    assert isinstance(parser_for(template, tools=TOOLS), cls)


def test_parser_for_override() -> None:
    assert isinstance(parser_for(SMOLLM2_TEMPLATE, override="mistral", tools=TOOLS), MistralParser)
    assert isinstance(parser_for(None, override="Qwen3_Coder", tools=None), Qwen3CoderParser)
    kimi = parser_for(None, override="kimi_k2", tools=TOOLS)
    assert isinstance(kimi, EndOnlyParser) and not kimi.streams_arguments
    with pytest.raises(ValueError):
        parser_for(None, override="nope", tools=TOOLS)


def test_tool_prompt() -> None:
    from kiln.worker.output.tool_prompt import render_tools_system_prompt, template_supports_tools

    assert not template_supports_tools(SMOLLM2_TEMPLATE)
    assert not template_supports_tools(None)
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    prompt = render_tools_system_prompt(TOOLS, "auto", True)
    assert "<tool_call>" in prompt and '"name":"get_weather"' in prompt and '"name":"run"' in prompt
    assert len(prompt) < 1500
    one = render_tools_system_prompt(TOOLS, {"type": "function", "name": "run"}, False)
    assert '"name":"get_weather"' not in one and "must call the function run" in one and "at most one" in one
    assert "at least one" in render_tools_system_prompt(TOOLS, "required", True)
    assert render_tools_system_prompt(TOOLS, "none", True) == ""
    assert render_tools_system_prompt([{"type": "web_search"}], "auto", True) == ""
    # The example in the prompt is itself a call the Hermes parser reads.
    example = prompt[prompt.index("<tool_call>\n{") :].split("</tool_call>")[0] + "</tool_call>"
    assert feed_chunks(HermesParser(TOOLS), [example]).final.calls[0].name == "function_name"  # type: ignore[union-attr]


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<function=run>", "</function>",
    "<parameter=cmd>", "<parameter=timeout>", "</parameter>", "<|tool_call_start|>", "<|tool_call_end|>",
    '{"name": "run", "arguments": ', '{"name": "get_weather", "parameters": ', '{"city": "Zü', 'rich"}', "}", "{", "[", "]",
    '"', "\\", ",", ";", " ", "\n", "run", "x(a=1)", "<", "hi", "1.5", "null", "é🌸",
]


@settings(max_examples=300, deadline=None)
@given(
    fmt=st.sampled_from(list(FORMATS)),
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
    cuts=st.lists(st.integers(min_value=1, max_value=300), max_size=25),
)
def test_garbage_any_split_equals_whole(fmt: str, parts: list[str], cuts: list[int]) -> None:
    """Arbitrary mixes of markup never hang, and split feeding changes nothing."""
    factory, _ = FORMATS[fmt]
    text = "".join(parts)
    whole = feed_chunks(factory(), [text])
    pieces = feed_chunks(factory(), split(text, cuts))
    assert (pieces.text, pieces.names, pieces.arguments, pieces.final) == (whole.text, whole.names, whole.arguments, whole.final)
    assert pieces.final is not None and pieces.final.text.startswith(pieces.text)
    for call in pieces.final.calls:
        assert isinstance(json.loads(call.arguments), dict)
