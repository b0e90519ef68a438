"""llguidance's compile options and limits, in one place for both daemons.

The gateway refuses a schema the worker could not enforce (kiln.gateway.doors.schema_check, the
tokenizer-free half of llguidance), and the worker compiles the same schema into a token mask
(kiln.worker.structured). Both must decide alike, or a request passes the gateway and fails on a
worker, or is refused although the worker would serve it. So the options each kind of schema is
compiled with, and the fuel limits, live here; neither module writes its own. No mlx here: the
gateway imports this.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal, cast

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact, fixed whitespace: a small model at temperature 1 given "flexible" whitespace will
# happily emit newlines until max_tokens.
JSON_COMPILE_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Tool arguments come from tool definitions that were not necessarily written for strict mode
# (``if``/``then``, ``dependentRequired``...): keywords llguidance does not implement are ignored
# instead of refusing the whole call. ``text.format`` schemas are strict: a keyword Kiln cannot
# enforce there is refused, since the client asked for a guarantee.
TOOL_ARGS_OPTIONS: dict[str, Any] = {**JSON_COMPILE_OPTIONS, "lenient": True}

SchemaUse = Literal["text_format", "tool_arguments"]


def compile_options(use: SchemaUse) -> "JsonCompileOptions":
    """The llguidance ``overrides`` a schema of this use is compiled with."""
    return cast("JsonCompileOptions", dict(TOOL_ARGS_OPTIONS if use == "tool_arguments" else JSON_COMPILE_OPTIONS))


def parser_limits() -> llguidance.LLParserLimits:
    """Fuel limits that bound compile and per-token mask work for any grammar."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        max_grammar_size=200_000,
        verbose_errors=False,
    )


def schema_grammar(schema: str | dict[str, Any], use: SchemaUse) -> str:
    """The llguidance grammar for a JSON schema (raises ValueError when it cannot be built)."""
    text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    grammar: str = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=compile_options(use))
    return grammar


def schema_error(schema: str | dict[str, Any], use: SchemaUse) -> str:
    """llguidance's first error for the schema compiled for ``use``, or '' when it compiles."""
    try:
        grammar = schema_grammar(schema, use)
    except ValueError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=parser_limits())
    return str(messages[0]) if is_error and messages else ""
