"""Describing tools in the system prompt for chat templates that cannot.

A template without a ``tools`` variable (SmolLM2's plain ChatML, say) would
silently drop the declared functions, so the worker prepends this block to
the system message instead. It teaches the Hermes ``<tool_call>`` syntax,
which ``tool_calls.select`` picks for such templates. It is kept short: small
models with 8k windows pay for every token of it on every turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from kiln.protocol.request import ToolChoice

from .tool_calls.base import Tools, only_functions

_TOOLS_VAR = re.compile(r"\btools\b")


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the chat template renders a ``tools`` argument itself."""
    return chat_template is not None and _TOOLS_VAR.search(chat_template) is not None


def _signature(tool: dict[str, Any]) -> str:
    entry: dict[str, Any] = {"name": tool["name"]}
    if tool.get("description"):
        entry["description"] = tool["description"]
    entry["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
    return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


def _chosen(tools: list[dict[str, Any]], choice: ToolChoice) -> tuple[list[dict[str, Any]], str]:
    """The tools to describe and the rule line for the tool mode."""
    if choice.mode == "named":
        return [t for t in tools if t["name"] == choice.name], f"You must call the function {choice.name}."
    if choice.allowed is not None:
        tools = [t for t in tools if t["name"] in set(choice.allowed)]
    if choice.mode == "required":
        return tools, "You must call at least one function."
    return tools, "Call a function when it helps answer; otherwise reply normally."


def render_tools_system_prompt(
    tools: Tools | None,
    tool_choice: ToolChoice | str | Mapping[str, Any] = "auto",
    parallel_tool_calls: bool = True,
) -> str:
    """The system-prompt block that declares ``tools`` ("" when none apply).

    Only function tools are described (other tool types have no schema a
    small model could follow); ``tool_choice="none"`` describes nothing.
    ``tool_choice``: the request's ``ToolChoice``, or its Responses API shape.
    """
    choice = tool_choice if isinstance(tool_choice, ToolChoice) else ToolChoice.from_api(tool_choice)
    if choice.mode == "none":
        return ""
    chosen, rule = _chosen(only_functions(tools), choice)
    if not chosen:
        return ""
    lines = [
        "# Tools",
        "You can call these functions (JSON Schema signatures):",
        "<tools>",
        *(_signature(t) for t in chosen),
        "</tools>",
        "To call one, write a JSON object with its name and arguments in <tool_call></tool_call> tags:",
        '<tool_call>\n{"name": "function_name", "arguments": {"arg": "value"}}\n</tool_call>',
        rule,
    ]
    if not parallel_tool_calls:
        lines.append("Call at most one function per reply.")
    return "\n".join(lines)
