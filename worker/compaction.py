"""Compaction: choose what to keep, summarize the rest (spec: Compaction).

The split rules, in the worker because they need token counts:
- system and developer messages are always kept verbatim;
- the retained part is the latest user message and everything after it, extended backwards by
  whole turns while it fits ``keep_tokens``;
- a split falls only before a user message or right after a completed tool group (a
  ``function_call_output`` not followed by another), so a call never loses its output;
- at least one turn is left to summarize, otherwise compaction would not shorten anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

SUMMARY_INSTRUCTIONS = (
    "You compress conversations. Write a concise summary of the conversation below: the user's "
    "goals, facts and decisions established, work done (including tool calls and their results) "
    "and anything still open. Write plain prose, no preamble."
)
SUMMARY_PREFIX = "Summary of the earlier conversation:\n"


class CompactionRefused(ValueError):
    """Compaction cannot produce a shorter context; the message says why."""


@dataclass
class Plan:
    kept: list[int]  # indices of system/developer messages
    summarized: list[int]  # indices folded into the summary
    retained: list[int]  # indices kept verbatim after the summary


def _is_system(item: dict) -> bool:
    return item.get("type", "message") == "message" and item.get("role") in ("system", "developer")


def _is_user(item: dict) -> bool:
    return item.get("type", "message") == "message" and item.get("role") == "user"


def split_points(items: list[dict], conversation: list[int]) -> list[int]:
    """Positions (into ``conversation``) where the history may be cut."""
    points = []
    for pos, index in enumerate(conversation):
        if pos == 0:
            continue
        item = items[index]
        previous = items[conversation[pos - 1]]
        after_tool_group = previous.get("type") == "function_call_output" and item.get("type") != "function_call_output"
        if _is_user(item) or after_tool_group:
            points.append(pos)
    return points


def plan(items: list[dict], keep_tokens: int, count: Callable[[list[dict]], int]) -> Plan:
    kept = [i for i, item in enumerate(items) if _is_system(item)]
    conversation = [i for i, item in enumerate(items) if not _is_system(item) and item.get("type") != "compaction_trigger"]
    users = [pos for pos, i in enumerate(conversation) if _is_user(items[i])]
    if not users:
        raise CompactionRefused("there is no user message to keep")
    cut = users[-1]
    if cut == 0:
        raise CompactionRefused("there is nothing before the latest user message to summarize")
    # Split points are never position 0, so at least one turn is always left to summarize.
    for point in sorted((p for p in split_points(items, conversation) if p < cut), reverse=True):
        if count([items[i] for i in conversation[point:]]) > keep_tokens:
            break
        cut = point
    return Plan(kept=kept, summarized=conversation[:cut], retained=conversation[cut:])


def transcript(items: list[dict]) -> str:
    """The summarized items as plain text for the summarizer's prompt."""
    lines = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            text = content if isinstance(content, str) else "".join(p.get("text") or p.get("refusal") or "" for p in content or [] if isinstance(p, dict))
            lines.append(f"{item.get('role', 'user')}: {text}")
        elif kind == "function_call":
            lines.append(f"assistant called {item.get('name')}({item.get('arguments', '')})")
        elif kind == "function_call_output":
            output = item.get("output")
            lines.append(f"tool result: {output if isinstance(output, str) else output!r}")
        elif kind == "reasoning":
            continue
    return "\n".join(lines)


def summary_budget(summarized_tokens: int, empty_summary_tokens: int, max_output_tokens: int) -> int:
    """Tokens the summary may take: half of what it replaces (less the summary message's own
    framing), within the request's ``max_output_tokens``. A fixed budget let a small model write
    a summary longer than the turns it summarized, and compaction then refused ordinary
    histories."""
    room = summarized_tokens - empty_summary_tokens
    return max(1, min(max_output_tokens, room // 2))


def retry_budget(budget: int, produced: int, excess: int) -> int | None:
    """The one retry's budget after a summary of ``produced`` tokens left the context ``excess``
    tokens too long (after >= before): short enough to remove the excess with a margin, and at
    most half the first budget; None when nothing shorter can be asked for."""
    tighter = min(budget // 2, produced - excess - 8)
    return tighter if tighter >= 1 else None


def summary_body(items: list[dict], max_output_tokens: int) -> dict:
    """A create body whose generation is the summary."""
    return {
        "instructions": SUMMARY_INSTRUCTIONS,
        "input": [{"type": "message", "role": "user", "content": "Conversation:\n" + transcript(items) + "\n\nSummarize it."}],
        "max_output_tokens": max_output_tokens,
        "temperature": 0,
    }


def summary_message(summary: str) -> dict:
    return {"type": "message", "role": "user", "content": SUMMARY_PREFIX + summary}
