"""The one interface every tool-call parser offers, and the events it emits.

The worker feeds decoded text to a parser as it is generated and turns the
events into Responses stream events; at the end it calls ``finish()``, whose
result is authoritative (the output items are built from it). Streaming is a
preview: a consumer compares what it streamed with the final parse and sends
the unsent rest.

Guarantees of every parser (tested by property tests for every format):

- ``TextDelta`` never carries markup of a call that parses; text that might be
  the start of markup is held back until it is disambiguated.
- The concatenated ``TextDelta`` texts are a prefix of ``FinalParse.text``
  (equal to it unless a malformed call was left unclosed at the end, which
  comes back as text in ``FinalParse.text`` rather than being lost).
- A call the text ends inside (cut off by ``max_output_tokens``) is never
  text: a parser that can tell one (Hermes, the forced-call syntax) reports
  it as ``FinalParse.cut``, with what was read of it.
- Text is whitespace-stripped at both ends (whitespace next to calls is
  formatting, not content).
- ``CallStarted.index`` counts calls from 0 in order; ``FinalParse.calls[i]``
  is the call streamed as index ``i``. The concatenated ``ArgumentsDelta``
  fragments of a call equal its final ``arguments`` (for well-formed output).
  Only a call that fails at the very end (cut off) can be missing from
  ``calls`` after it was started; a call that started but turned out
  malformed mid-stream is also dropped, and then later indices shift (rare:
  it needs arguments whose brackets balance but which are not valid JSON).
- Feeding the same text split differently gives the same events' contents
  (the same text, calls and arguments concatenations).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TextDelta:
    """Plain assistant text (never contains tool-call markup)."""

    text: str


@dataclass
class CallStarted:
    """A call's name became known; its arguments follow as ArgumentsDelta."""

    index: int
    name: str


@dataclass
class ArgumentsDelta:
    """A fragment of call ``index``'s JSON arguments text."""

    index: int
    delta: str


@dataclass
class ParsedCall:
    """One complete call; ``arguments`` is a JSON object text."""

    name: str
    arguments: str


@dataclass
class CutCall:
    """A call the text ended inside: its name if it was read (else None) and its arguments so
    far, a prefix of a JSON object ("" before the object began). Reported as an incomplete call,
    so that template markup never reaches a client as message text."""

    name: str | None
    arguments: str


@dataclass
class FinalParse:
    """The authoritative parse of everything fed; ``cut``: the call it ended inside, if any."""

    text: str
    calls: list[ParsedCall] = field(default_factory=list)
    cut: CutCall | None = None


ParserEvent = TextDelta | CallStarted | ArgumentsDelta

# Declared tools in the flat Responses shape:
# {"type": "function", "name", "description", "parameters"}.
Tools = list[dict[str, Any]]


class ToolCallParser(ABC):
    """Incremental parser of one generation's text into text and tool calls.

    One instance per generation: ``feed`` the decoded text as it arrives, then
    ``finish`` once. ``streams_arguments`` says whether calls come out while
    generated (True) or only from ``finish`` (False, the end-only formats).
    """

    streams_arguments: bool = True

    @abstractmethod
    def feed(self, text: str) -> list[ParserEvent]:
        """Consume the next piece of generated text and return what it settles."""

    @abstractmethod
    def finish(self) -> FinalParse:
        """Flush everything held back and return the authoritative parse."""


def only_functions(tools: Tools | None) -> list[dict[str, Any]]:
    """The declared function tools (other tool types have no schema here)."""
    return [t for t in tools or () if t.get("type", "function") == "function" and t.get("name")]


def parameter_schemas(tools: Tools | None) -> dict[str, dict[str, Any]]:
    """Map function name -> its ``parameters.properties`` (for type conversion)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in only_functions(tools):
        params = tool.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        out[tool["name"]] = props if isinstance(props, dict) else {}
    return out


def nested_tools(tools: Tools | None) -> list[dict[str, Any]]:
    """The tools in the Chat Completions shape mlx-lm's tool_parsers expect."""
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}},
            },
        }
        for t in only_functions(tools)
    ]
