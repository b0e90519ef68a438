"""Per-model choices made once at load: how tools are rendered and how output is parsed."""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Any

from .output.router import make_router
from .output.tool_calls.select import parser_for
from .output.tool_prompt import render_tools_system_prompt, template_supports_tools
from .prompt import RenderOptions, function_tools

log = logging.getLogger("kiln.worker.setup")


def model_extras(tokenizer: Any, tool_parser: str | None, constraints: "Constraints | None" = None) -> dict[str, Any]:
    """Keyword arguments for GenerationService that depend on the loaded model (and --tool-parser).

    ``constraints``: the model's grammar compiler, when the caller started building it earlier."""
    template = getattr(tokenizer, "chat_template", None) or ""
    takes_tools = template_supports_tools(template)
    override = tool_parser

    def tools_prompt(body: dict) -> str | None:
        if takes_tools:
            return None
        return render_tools_system_prompt(function_tools(body.get("tools") or []), body.get("tool_choice", "auto"), body.get("parallel_tool_calls", True)) or None

    parser_for(template, override=override)  # an unknown --tool-parser fails at start, not per request

    def router_factory(body: dict, prompt_text: str):
        tools = function_tools(body.get("tools") or [])
        choice = body.get("tool_choice", "auto")
        # A forced call is generated in the Hermes syntax the grammar spells out, whatever the
        # model's own format, so it is parsed as Hermes.
        chosen = "hermes" if forced_choice(tools, choice) else override
        return make_router(prompt_text, tools=tools, tool_choice=choice, parser_factory=partial(_parser, template, chosen))

    constraints = constraints or Constraints(tokenizer)
    return {
        "render_options": RenderOptions(template_takes_tools=takes_tools),
        "router_factory": router_factory,
        "tools_prompt": tools_prompt,
        "constraint_factory": constraints.for_body,
    }


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

    def for_body(self, body: dict) -> list:
        """Processors for one request; raises ValueError for a grammar that cannot compile."""
        from .structured import GrammarError

        choice = body.get("tool_choice", "auto")
        tools = function_tools(body.get("tools") or [])
        forced = forced_choice(tools, choice)
        fmt = (body.get("text") or {}).get("format")
        if not forced and (not fmt or fmt.get("type", "text") == "text"):
            return []
        try:
            if forced:
                # Exactly one call: small models otherwise keep calling until the token limit.
                return [self.compiler().tool_call_processor(strict_tools(tools), choice, False)]
            return [self.compiler().processor_for(fmt)]
        except GrammarError as exc:
            raise ValueError(str(exc)) from exc


def forced_choice(tools: list[dict], choice: Any) -> bool:
    """``tool_choice`` demands a call: "required" or a named function."""
    return bool(tools) and (choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function"))


def _parser(template: str, override: str | None, tools: list[dict]):
    return parser_for(template, override=override, tools=tools)


def strict_tools(tools: list[dict]) -> list[dict]:
    """Tools whose object schemas close ``additionalProperties`` unless the tool opts out with
    ``strict: false`` (the Responses API's default for function tools is strict)."""
    return [t if t.get("strict") is False else {**t, "parameters": _closed(t.get("parameters") or {"type": "object", "properties": {}})} for t in tools]


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
