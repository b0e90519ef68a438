"""Render Hugging Face chat templates (Jinja2) the way `transformers` does.

Model authors write their templates against the environment that
`transformers` builds, so we reproduce its observable behaviour: a sandboxed,
immutable environment with `trim_blocks` / `lstrip_blocks`, the loop-control
extension, a `tojson` filter that keeps non-ASCII text as-is, and the
`raise_exception` / `strftime_now` globals. The `{% generation %}` tag (used
by some templates to mark assistant spans for training masks) is accepted and
rendered transparently.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render (including `raise_exception`)."""


def _raise_exception(message: str) -> None:
    # Templates call this to reject inputs they cannot render (e.g. bad roles).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes and forces ASCII; HF's does neither.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` and render its body as-is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    # Compiling is the expensive part; a worker renders the same template per request.
    try:
        return _ENV.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render `source` with the variables `transformers` passes.

    `special_tokens` supplies `bos_token`, `eos_token`, ... as strings; extra
    keyword arguments (e.g. `enable_thinking`, `reasoning_effort`) are passed
    through to the template, as `apply_chat_template(**kwargs)` does in HF.
    """
    template = _compile(source)
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(kwargs)
    variables.update(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
    )
    variables.setdefault("documents", None)
    try:
        return template.render(**variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(str(exc)) from exc
