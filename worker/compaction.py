"""Compaction: choose what to keep, summarize the rest (spec: Compaction).

The split rules, in the worker because they need token counts:
- system and developer messages are always kept verbatim;
- the retained part is the latest user message and everything after it, extended backwards by
  whole turns while it fits ``keep_tokens``;
- a split falls only before a user message or right after a completed tool group (a
  ``function_call_output`` not followed by another), so a call never loses its output;
- a history with nothing before its latest user message (or with no user message) has nothing
  to summarize: everything is retained and the summary is empty (a client may compact any
  history; automatic compaction refuses that result, since it shortens nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiln.protocol.request import ContentPart, FunctionCall, FunctionCallOutput, GenerateRequest, InputItem, Marker, Message, Sampling

SUMMARY_INSTRUCTIONS = (
    "You compress conversations. Write a concise summary of the conversation below: the user's "
    "goals, facts and decisions established, work done (including tool calls and their results) "
    "and anything still open. Write plain prose, no preamble."
)
SUMMARY_PREFIX = "Summary of the earlier conversation:\n"


TRIGGER = Marker("compaction_trigger")


class CompactionRefused(ValueError):
    """Compaction cannot produce a shorter context; the message says why."""


@dataclass
class Plan:
    kept: list[int]  # indices of system/developer messages
    summarized: list[int]  # indices folded into the summary
    retained: list[int]  # indices kept verbatim after the summary


def _is_system(item: InputItem) -> bool:
    return isinstance(item, Message) and item.role in ("system", "developer")


def _is_user(item: InputItem) -> bool:
    return isinstance(item, Message) and item.role == "user"


def split_points(items: Sequence[InputItem], conversation: list[int]) -> list[int]:
    """Positions (into ``conversation``) where the history may be cut."""
    points = []
    for pos, index in enumerate(conversation):
        if pos == 0:
            continue
        item = items[index]
        previous = items[conversation[pos - 1]]
        after_tool_group = isinstance(previous, FunctionCallOutput) and not isinstance(item, FunctionCallOutput)
        if _is_user(item) or after_tool_group:
            points.append(pos)
    return points


def plan(items: Sequence[InputItem], keep_tokens: int, count: Callable[[list[InputItem]], int]) -> Plan:
    kept = [i for i, item in enumerate(items) if _is_system(item)]
    conversation = [i for i, item in enumerate(items) if not _is_system(item) and item != TRIGGER]
    users = [pos for pos, i in enumerate(conversation) if _is_user(items[i])]
    cut = users[-1] if users else 0
    if cut == 0:  # nothing before the latest user message: nothing to summarize
        return Plan(kept=kept, summarized=[], retained=conversation)
    # Split points are never position 0, so at least one turn is always left to summarize.
    for point in sorted((p for p in split_points(items, conversation) if p < cut), reverse=True):
        if count([items[i] for i in conversation[point:]]) > keep_tokens:
            break
        cut = point
    return Plan(kept=kept, summarized=conversation[:cut], retained=conversation[cut:])


def transcript(items: Sequence[InputItem]) -> str:
    """The summarized items as plain text for the summarizer's prompt."""
    lines = []
    for item in items:
        if isinstance(item, Message):
            lines.append(f"{item.role}: {item.text}")
        elif isinstance(item, FunctionCall):
            lines.append(f"assistant called {item.name}({item.arguments})")
        elif isinstance(item, FunctionCallOutput):
            lines.append(f"tool result: {item.output}")
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


def summary_request(model: str, items: Sequence[InputItem], max_output_tokens: int) -> GenerateRequest:
    """A request whose generation is the summary."""
    ask = "Conversation:\n" + transcript(items) + "\n\nSummarize it."
    return GenerateRequest(
        model=model,
        instructions=SUMMARY_INSTRUCTIONS,
        input=(Message("user", (ContentPart("input_text", ask),)),),
        sampling=Sampling(temperature=0, max_output_tokens=max_output_tokens),
    )


def summary_message(summary: str) -> Message:
    return Message("user", (ContentPart("input_text", SUMMARY_PREFIX + summary),))
