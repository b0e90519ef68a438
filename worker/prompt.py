"""Responses ``input`` items -> chat messages -> the model's prompt text.

The worker owns rendering because only it knows the chat template. The gateway sends the fully
expanded input (history included); this module turns it into the message list a Hugging Face chat
template expects and renders it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol


class ChatTemplate(Protocol):
    chat_template: str | None

    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


@dataclass
class RenderOptions:
    """How the template is driven; decided once per loaded model."""

    template_takes_tools: bool = False
    # Prepended to the system message when the template cannot render tools itself.
    tools_system_prompt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def content_text(content: Any) -> str:
    """The text of a message's ``content``: a string or a list of text-bearing parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for part in content:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "refusal":
            pieces.append(part.get("refusal") or "")
        else:
            pieces.append(part.get("text") or "")
    return "".join(pieces)


def _function_output_text(output: Any) -> str:
    return output if isinstance(output, str) else content_text(output)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


def to_messages(instructions: str | None, items: list[dict], *, tool_markup: bool) -> list[dict]:
    """Map Responses items onto chat messages.

    ``tool_markup`` renders calls and their outputs as Hermes-style text for templates that do not
    understand ``tool_calls`` / the ``tool`` role themselves.
    """
    system_parts = [instructions] if instructions else []
    messages: list[dict] = []
    pending_reasoning: str | None = None
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role", "user")
            text = content_text(item.get("content"))
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
        elif kind == "function_call":
            call = {"name": item.get("name", ""), "arguments": _arguments(item.get("arguments", ""))}
            if tool_markup:
                text = "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
                _append(messages, {"role": "assistant", "content": text})
            else:
                tool_call = {"id": item.get("call_id"), "type": "function", "function": call}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(tool_call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            output = _function_output_text(item.get("output"))
            if tool_markup:
                _append(messages, {"role": "user", "content": "<tool_response>\n" + output + "\n</tool_response>"})
            else:
                messages.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
        elif kind == "reasoning":
            texts = [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)]
            pending_reasoning = "".join(texts) or None
        # compaction items are expanded by the caller before rendering; item_reference and
        # compaction_trigger carry no text of their own.
    if system_parts:
        messages.insert(0, {"role": "system", "content": "\n\n".join(p for p in system_parts if p)})
    return messages


def _append(messages: list[dict], message: dict) -> None:
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


def function_tools(tools: list[dict]) -> list[dict]:
    """Declared tools flattened to plain functions; namespace members keep their own names."""
    flat = []
    for tool in tools or []:
        if tool.get("type") == "namespace":
            flat.extend({**fn, "type": "function"} for fn in tool.get("tools", []))
        elif tool.get("type") == "function":
            flat.append(tool)
    return flat


def chat_template_tools(tools: list[dict]) -> list[dict]:
    """Functions in the nested shape Hugging Face chat templates iterate over."""
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]


def render(body: dict, template: ChatTemplate, options: RenderOptions, *, tools_prompt: str | None = None) -> str:
    """The prompt text for a create body (its ``input`` already expanded by the gateway).

    ``raw_prompt`` (set by the gateway's legacy ``/v1/completions`` door) is the prompt text
    itself: a plain continuation, no chat template."""
    raw = body.get("raw_prompt")
    if isinstance(raw, str):
        return raw
    tools = function_tools(body.get("tools") or [])
    if body.get("tool_choice") == "none":
        tools = []
    markup = not options.template_takes_tools
    instructions = body.get("instructions")
    if tools and markup and tools_prompt:
        instructions = tools_prompt + ("\n\n" + instructions if instructions else "")
    messages = to_messages(instructions, body.get("input") or [], tool_markup=markup)
    kwargs: dict[str, Any] = {}
    if tools and options.template_takes_tools:
        kwargs["tools"] = chat_template_tools(tools)
    return template.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
