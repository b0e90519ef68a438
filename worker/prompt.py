"""A request's input items -> chat messages -> the model's prompt text.

The worker owns rendering because only it knows the chat template. The gateway sends the fully
expanded input (history included) as typed items (``kiln.protocol.request``); this module turns
them into the message list a Hugging Face chat template expects and renders it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kiln.protocol.request import FunctionCall, FunctionCallOutput, GenerateRequest, InputItem, Message, Reasoning, ToolSpec


class ChatTemplate(Protocol):
    chat_template: str | None

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


@dataclass
class RenderOptions:
    """How the template is driven; decided once per loaded model."""

    template_takes_tools: bool = False
    # Prepended to the system message when the template cannot render tools itself.
    tools_system_prompt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


def to_messages(instructions: str | None, items: Sequence[InputItem], *, tool_markup: bool) -> list[dict[str, Any]]:
    """Map the request's input items onto chat messages.

    ``tool_markup`` renders calls and their outputs as Hermes-style text for templates that do not
    understand ``tool_calls`` / the ``tool`` role themselves.
    """
    system_parts = [instructions] if instructions else []
    messages: list[dict[str, Any]] = []
    pending_reasoning: str | None = None
    for item in items:
        if isinstance(item, Message):
            role, text = item.role, item.text
            if role in ("system", "developer"):
                if not messages:
                    system_parts.append(text)
                else:
                    messages.append({"role": "system", "content": text})
                continue
            message = {"role": role, "content": text}
            if role == "assistant" and pending_reasoning:
                message["reasoning_content"] = pending_reasoning
                pending_reasoning = None
            _append(messages, message)
        elif isinstance(item, FunctionCall):
            call = {"name": item.name, "arguments": _arguments(item.arguments)}
            if tool_markup:
                text = "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
                _append(messages, {"role": "assistant", "content": text})
            else:
                tool_call = {"id": item.call_id, "type": "function", "function": call}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(tool_call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
        elif isinstance(item, FunctionCallOutput):
            if tool_markup:
                _append(messages, {"role": "user", "content": "<tool_response>\n" + item.output + "\n</tool_response>"})
            else:
                messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        elif isinstance(item, Reasoning):
            pending_reasoning = item.text or None
        # Markers (compaction_trigger) carry no text of their own; compaction items were
        # expanded by the gateway.
    if system_parts:
        messages.insert(0, {"role": "system", "content": "\n\n".join(p for p in system_parts if p)})
    return messages


def _append(messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
    """Append, merging consecutive messages of one role (several templates demand alternation)."""
    last = messages[-1] if messages else None
    if (
        last is not None
        and last["role"] == message["role"]
        and message["role"] in ("user", "assistant")
        and "tool_calls" not in last
        and "tool_calls" not in message
    ):
        last["content"] = (last["content"] + "\n\n" + message["content"]).strip("\n")
        return
    messages.append(message)


def chat_template_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Functions in the nested shape Hugging Face chat templates iterate over."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)}} for t in tools]


def render(request: GenerateRequest, template: ChatTemplate, options: RenderOptions, *, tools_prompt: str | None = None) -> str:
    """The prompt text for a request (its input already expanded by the gateway).

    ``raw_prompt`` (the gateway's legacy ``/v1/completions`` door) is the prompt text itself: a
    plain continuation, no chat template."""
    if request.raw_prompt is not None:
        return request.raw_prompt
    tools = request.offered_tools
    markup = not options.template_takes_tools
    instructions = request.instructions
    if tools and markup and tools_prompt:
        instructions = tools_prompt + ("\n\n" + instructions if instructions else "")
    messages = to_messages(instructions, request.input, tool_markup=markup)
    kwargs: dict[str, Any] = {}
    if tools and options.template_takes_tools:
        kwargs["tools"] = chat_template_tools(tools)
    return template.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
