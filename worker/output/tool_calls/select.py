"""Choosing the tool-call format of a model from its chat template.

The template is what taught the model its call syntax, so its markers tell
the format (the same idea, and mostly the same order, as mlx-lm's
``_infer_tool_parser``). Templates without tool support get the Hermes
format, which ``tool_prompt`` teaches in the system prompt.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import ToolCallParser, Tools
from .end_only import EndOnlyParser
from .hermes import HermesParser
from .llama3 import Llama3Parser
from .mistral import MistralParser
from .qwen3_coder import Qwen3CoderParser

_STREAMING: dict[str, Callable[[Tools | None], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser,
}

_ALIASES = {
    "json_tools": "hermes",
    "qwen": "hermes",
    "qwen2_5": "hermes",
    "llama": "llama3",
    "llama3_json": "llama3",
    "qwen3coder": "qwen3_coder",
}

# mlx-lm tool_parsers modules parsed only at the end.
END_ONLY_FORMATS = (
    "pythonic",
    "function_gemma",
    "gemma4",
    "glm47",
    "laguna",
    "kimi_k2",
    "kimi_k3",
    "longcat",
    "minicpm5",
    "minimax_m2",
    "muse_spark",
)

FORMATS = tuple(_STREAMING) + END_ONLY_FORMATS


def format_for_template(chat_template: str | None) -> str:
    """The format name a chat template's markers point to ('hermes' by default)."""
    t = chat_template or ""
    checks: list[tuple[bool, str]] = [
        ("<minimax:tool_call>" in t, "minimax_m2"),
        ("<|tool_call>" in t and "<tool_call|>" in t, "gemma4"),
        ("<start_function_call>" in t, "function_gemma"),
        ("<longcat_tool_call>" in t, "longcat"),
        ("<arg_key>" in t, "glm47"),
        ("<|tool_list_start|>" in t or "<|tool_call_start|>" in t, "pythonic"),
        ("<function=" in t and ("<parameter=" in t or "<tool_call>" in t), "qwen3_coder"),
        ("<|tool_calls_section_begin|>" in t, "kimi_k2"),
        ('<function name="' in t and '<param name="' in t, "minicpm5"),
        ("[TOOL_CALLS]" in t, "mistral"),
        ("<atem:function_calls>" in t, "muse_spark"),
        ("<tool_call>" in t, "hermes"),
        ("<|python_tag|>" in t, "llama3"),
    ]
    return next((name for hit, name in checks if hit), "hermes")


def format_name(chat_template: str | None, override: str | None = None) -> str:
    """The format a model's output is parsed in: ``override`` (aliases resolved), else the
    template's."""
    name = format_for_template(chat_template) if override is None else override.strip().lower()
    return _ALIASES.get(name, name)


def parser_for(
    chat_template: str | None,
    *,
    override: str | None = None,
    tools: Tools | None = None,
) -> ToolCallParser:
    """A fresh parser for one generation; ``override`` names the format outright."""
    name = format_name(chat_template, override)
    if name in _STREAMING:
        return _STREAMING[name](tools)
    if name in END_ONLY_FORMATS:
        return EndOnlyParser(name, tools)
    raise ValueError(f"unknown tool-call format {override!r}; known: {', '.join(FORMATS)}")
