"""Structured output and forced tool calls as the engine's own constrained decoding.

The MLX worker masks logits with llguidance (worker/structured.py); an upstream engine samples
by itself, so the constraint must be one it compiles. All three engines take a JSON schema
(llama-server ``json_schema``, turned into GBNF by the server; vLLM ``structured_outputs.json``;
SGLang ``json_schema``), so both constraints are written as one:

- ``text.format`` json_schema / json_object: the schema, narrowed exactly as the MLX path narrows
  it (``bounded_formats``: dates as patterns, bounded e-mail lengths);
- a forced call (tool_choice "required" or a named function): the Hermes call the MLX path forces,
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``. The tags are not JSON, so they
  are written by the worker (``prefix`` is appended to the prompt and streamed as the first
  output tokens, ``suffix`` streamed after the engine's JSON) and the engine is constrained to
  the JSON between them: one object per callable function, its name a constant and its
  arguments that function's (strict) parameters schema. The router then parses it as Hermes,
  as it does for a forced call on the MLX path (setup.py).

An engine started without constrained decoding (``--no-upstream-constrained``) advertises no
structured output, and a request that needs it gets a 400 that says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.protocol.request import GenerateRequest

from ..setup import strict_tools
from ..structured import GrammarError, bounded_formats

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
UNCONSTRAINED = "This model's engine does not do constrained decoding, so {what} is not available for it."


@dataclass(frozen=True)
class EngineConstraint:
    """What the engine must generate: JSON matching ``schema``, between text the worker writes."""

    schema: dict[str, Any]
    prefix: str = ""
    suffix: str = ""
    # For logs and tests: "format" or "tool_call".
    kind: str = field(default="format", compare=False)


class Constraints:
    """The ``constraint_factory`` of GenerationService for an upstream engine."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def available(self, timeout: float = 0.0) -> bool:
        """capabilities.describe's question (structured output offered?), for an engine."""
        return self.enabled

    def for_request(self, request: GenerateRequest) -> list[EngineConstraint]:
        """The request's constraint (none, or one); ValueError (a 400) when it cannot be had."""
        forced = request.forces_call
        if not forced and not request.text_format.constrained:
            return []
        if not self.enabled:
            raise ValueError(UNCONSTRAINED.format(what="a forced tool_choice" if forced else "text.format " + request.text_format.type))
        if forced:
            return [tool_call_constraint(strict_tools(request.tools), request)]
        return [format_constraint(request.text_format.to_api())]


def format_constraint(text_format: dict[str, Any]) -> EngineConstraint:
    if text_format.get("type") == "json_object":
        return EngineConstraint({"type": "object"})
    schema = text_format.get("schema")
    if not isinstance(schema, dict):
        raise GrammarError("text.format.schema must be a JSON schema object")
    return EngineConstraint(bounded_formats(schema))


def tool_call_constraint(functions: list[dict[str, Any]], request: GenerateRequest) -> EngineConstraint:
    choice = request.tool_choice
    if choice.mode == "named":
        selected = [f for f in functions if f["name"] == choice.name]
        if not selected:
            raise GrammarError(f"tool_choice names function {choice.name!r}, which is not among the tools")
    else:
        selected = functions if choice.allowed is None else [f for f in functions if f["name"] in choice.allowed]
    if not selected:
        raise GrammarError("tool_choice 'required' needs at least one function tool")
    calls = [_call_schema(f) for f in selected]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return EngineConstraint(schema, prefix=OPEN_TAG + "\n", suffix="\n" + CLOSE_TAG, kind="tool_call")


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": bounded_formats(params) if isinstance(params, dict) and params else {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
