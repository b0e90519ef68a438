"""What this worker's model can do, from what it actually loaded (sent in ``Register``).

Each answer comes from the object that does the work, not from the model's name: the tool-call
format is the one the output will be parsed in, reasoning is there when the chat template (or the
vocabulary) has the thinking block the reasoning splitter looks for, and structured output is
there when llguidance could be built for this tokenizer.
"""

from __future__ import annotations

import logging
from typing import Any

from kiln.protocol.capabilities import Capabilities

from .output.reasoning import ReasoningSplitter
from .output.tool_calls.select import format_name
from .output.tool_prompt import template_supports_tools
from .setup import Constraints

log = logging.getLogger("kiln.worker.capabilities")

REASONING_PARSER = "think"  # ReasoningSplitter: a leading <think>...</think> block
# The grammar compiler is built in the background while the model is set up; a worker waits this
# long for it before registering (it takes about a second for a 50k vocabulary).
STRUCTURED_WAIT_S = 300.0


def _has_token(tokenizer: Any, text: str) -> bool:
    try:
        return tokenizer.hf_tokenizer.token_to_id(text) is not None
    except Exception:  # a tokenizer without a Hugging Face view (the scripted engine's)
        return False


def describe(tokenizer: Any, tool_parser: str | None, constraints: Constraints, default_max_output_tokens: int) -> Capabilities:
    template = getattr(tokenizer, "chat_template", None) or ""
    think = ReasoningSplitter().open_tag
    reasoning = think in template or _has_token(tokenizer, think)
    structured = constraints.available(STRUCTURED_WAIT_S)
    return Capabilities(
        tools=True,
        tool_parser=format_name(template, tool_parser),
        tools_in_template=template_supports_tools(template),
        reasoning=reasoning,
        reasoning_parser=REASONING_PARSER if reasoning else None,
        structured_output=structured,
        default_max_output_tokens=default_max_output_tokens,
    )
