"""Per-model choices made once at load: how tools are rendered and how output is parsed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from kiln.protocol.request import GenerateRequest, ToolSpec

from .output.router import ResponseRouter, make_router
from .output.tool_calls.base import ToolCallParser
from .output.tool_calls.select import parser_for
from .output.tool_prompt import render_tools_system_prompt, template_supports_tools
from .prompt import RenderOptions

if TYPE_CHECKING:  # engine.types imports mlx, which the upstream and scripted workers never load
    from .engine.types import LogitsProcessor

log = logging.getLogger("kiln.worker.setup")


def model_extras(tokenizer: Any, tool_parser: str | None, constraints: Constraints | None = None) -> dict[str, Any]:
    """Keyword arguments for GenerationService that depend on the loaded model (and --tool-parser).

    ``constraints``: the model's grammar compiler, when the caller started building it earlier."""
    template = getattr(tokenizer, "chat_template", None) or ""
    takes_tools = template_supports_tools(template)
    override = tool_parser

    def tools_prompt(request: GenerateRequest) -> str | None:
        if takes_tools:
            return None
        return render_tools_system_prompt(functions(request), request.tool_choice, request.parallel_tool_calls) or None

    parser_for(template, override=override)  # an unknown --tool-parser fails at start, not per request

    def router_factory(request: GenerateRequest, prompt_text: str) -> ResponseRouter:
        # A forced call is generated in the Hermes syntax the grammar spells out, whatever the
        # model's own format, so it is parsed as Hermes.
        chosen = "hermes" if request.forces_call else override
        return make_router(prompt_text, tools=functions(request), tool_choice=request.tool_choice.mode, parser_factory=partial(_parser, template, chosen), forced=request.forces_call,
            forced_name=forced_name(request))

    constraints = constraints or Constraints(tokenizer)
    return {
        "render_options": RenderOptions(template_takes_tools=takes_tools),
        "router_factory": router_factory,
        "tools_prompt": tools_prompt,
        "constraint_factory": constraints.for_request,
    }


def forced_name(request: GenerateRequest) -> str | None:
    """The one function a forced call can be (a named choice, or ``required`` with one candidate);
    None when the call is not forced or could be one of several."""
    choice = request.tool_choice
    if not request.forces_call:
        return None
    if choice.mode == "named":
        return choice.name
    names = [t.name for t in request.tools]
    candidates = [n for n in names if choice.allowed is None or n in choice.allowed]
    return candidates[0] if len(candidates) == 1 else None


def functions(request: GenerateRequest) -> list[dict[str, Any]]:
    """The request's tools (already flat) in the function shape the prompt, grammar and parser
    builders take."""
    return [t.as_function() for t in request.tools]


class Constraints:
    """Logits processors that enforce ``text.format`` and forced ``tool_choice``.

    The llguidance tokenizer view takes a second or more to build, so it is built on a
    background thread at start and awaited by the first request that needs it.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._compiler: Any = None
        self._ready = threading.Event()
        self._error: Exception | None = None
        threading.Thread(target=self._build, name="kiln-grammar-init", daemon=True).start()

    def _build(self) -> None:
        try:
            from .structured import GrammarCompiler

            self._compiler = GrammarCompiler.from_tokenizer(self._tokenizer)
        except Exception as exc:  # reported to the requests that need it
            log.exception("structured output is unavailable: the grammar compiler could not be built")
            self._error = exc
        finally:
            self._ready.set()

    def available(self, timeout: float) -> bool:
        """Whether structured output works for this tokenizer: the compiler was built (waiting up
        to `timeout` seconds for it)."""
        return self._ready.wait(timeout) and self._error is None

    def compiler(self) -> Any:
        self._ready.wait()
        if self._error is not None:
            raise ValueError("Structured output is unavailable for this model.")
        return self._compiler

    def for_request(self, request: GenerateRequest) -> list[LogitsProcessor]:
        """Processors for one request; raises ValueError for a grammar that cannot compile."""
        from .structured import GrammarError

        forced = request.forces_call
        if not forced and not request.text_format.constrained:
            return []
        try:
            if forced:
                # Exactly one call: small models otherwise keep calling until the token limit.
                return [self.compiler().tool_call_processor(strict_tools(request.tools), request.tool_choice, False)]
            return [self.compiler().processor_for(request.text_format.to_api())]
        except GrammarError as exc:
            raise ValueError(str(exc)) from exc


def _parser(template: str, override: str | None, tools: list[dict[str, Any]]) -> ToolCallParser:
    return parser_for(template, override=override, tools=tools)


def strict_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as functions whose object schemas close ``additionalProperties`` unless the tool
    opts out with ``strict: false`` (the Responses API's default for function tools is strict)."""
    return [{**t.as_function(), "parameters": _closed(dict(t.parameters))} if t.strict else t.as_function() for t in tools]


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
