"""What a worker's model can do, as the worker loaded it.

The worker fills one ``Capabilities`` from what it actually loaded (its chat template, the
tool-call format chosen for it, whether llguidance could be built for its tokenizer) and sends it
in ``Register.features``; the gateway reads it back once, at registration, and lists it per model
in ``/v1/models``. Decoding is tolerant: a field an older worker leaves out, or sends with the
wrong type, takes its default rather than refusing the worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Capabilities:
    # Function tools: every model takes them; the template renders them itself, or Kiln's system
    # prompt teaches the call syntax. `tool_parser` is the format its output is parsed in.
    tools: bool = True
    tool_parser: str | None = None
    tools_in_template: bool = False
    # Reasoning: the template or vocabulary has a thinking block, split out by `reasoning_parser`.
    reasoning: bool = False
    reasoning_parser: str | None = None
    # Structured output (text.format json_schema / json_object, forced tool calls): llguidance
    # was built for this tokenizer.
    structured_output: bool = False
    default_max_output_tokens: int | None = None  # the cap of a request that sets none

    def to_map(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_map(cls, raw: Any) -> Capabilities:
        if not isinstance(raw, dict):
            return cls()
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = raw.get(f.name)
            default = f.default
            if isinstance(default, bool):
                ok = isinstance(value, bool)
            elif f.name == "default_max_output_tokens":
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            else:  # an optional name
                ok = isinstance(value, str) and 0 < len(value) <= 64
            if ok:
                values[f.name] = value
        return cls(**values)
