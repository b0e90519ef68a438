"""``kiln codex-config``: a Codex CLI provider block and model catalog for a running Kiln.

Codex CLI (``@openai/codex``) talks to any Responses provider, but with only ``base_url`` and
``env_key`` it assumes OpenAI's model metadata: a 272k-token context window and an ~9k-token first
request, more than a small local model holds. This command asks the gateway what its workers serve
(``GET {base}/models``), writes a model catalog (``{"models": [ModelInfo]}``, Codex's
``model_catalog_json``) sized for each model's window, and prints the ``config.toml`` lines that
point Codex at Kiln. See docs/codex.md.

Field names and values follow Codex's ``ModelInfo`` (codex-rs/protocol, ``openai_models.rs``); a
catalog Codex cannot parse is rejected as a whole, so every field Codex requires is always written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8080/v1"
DEFAULT_ENV_KEY = "KILN_API_KEY"
# Windows up to this size get the short instructions and the small tool set.
SMALL_WINDOW = 32_768

SHORT_INSTRUCTIONS = (
    "You are a coding assistant running in a terminal. Answer the user's request directly and "
    "briefly. Use a tool only when the request needs it, and say what you did."
)

LONG_INSTRUCTIONS = """You are Codex, a coding agent running in the user's terminal, backed by a model served by Kiln.

- Work on the user's request until it is done, then stop and summarise what changed.
- Read files and run commands with the shell tool; prefer `rg` for searching. Keep commands short and
  non-interactive, and work inside the current directory.
- Edit files with the apply_patch tool when it is available; keep changes small and focused, match the
  surrounding style, and do not reformat unrelated code.
- Never run destructive commands (deleting files, resetting version control) unless the user asked for them.
- When a command fails, read the error, fix the cause and try again; do not repeat the same failing call.
- Use the plan tool for work of several steps and keep it up to date.
- Answer questions directly. Keep the final message brief: what you did, what is left, how to check it."""


def default_codex_home() -> Path:
    return Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")


def fetch_models(base_url: str, api_key: str | None = None, timeout: float = 10) -> list[dict[str, Any]]:
    """The models the gateway's workers serve, as ``GET {base}/models`` lists them."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=timeout)
    r.raise_for_status()
    return list(r.json().get("data") or [])


def auto_compact_limit(window: int) -> int:
    """Where Codex compacts: leave a quarter of the window (1k..16k tokens) for the model's output."""
    reserve = min(max(window // 4, 1024), 16_384)
    return max(window - reserve, window // 2)


def model_info(model: dict[str, Any], *, shell_type: str | None = None, auto_compact: int | None = None, priority: int = 0) -> dict[str, Any]:
    """One Codex ``ModelInfo`` for a model of ``GET /models``."""
    slug = model["id"]
    window = int(model.get("context_window") or 8192)
    small = window <= SMALL_WINDOW
    reasoning = bool(model.get("reasoning") or model.get("supports_reasoning"))
    levels = (
        [
            {"effort": "low", "description": "Think briefly"},
            {"effort": "medium", "description": "Think as needed"},
            {"effort": "high", "description": "Think longer"},
        ]
        if reasoning
        else []
    )
    return {
        "slug": slug,
        "display_name": slug,
        "description": f"{slug} served by Kiln ({window}-token context)",
        "default_reasoning_level": "medium" if reasoning else None,
        "supported_reasoning_levels": levels,
        # shell_command: one small `shell` function; unified_exec (exec_command + write_stdin) costs more prompt.
        "shell_type": shell_type or ("shell_command" if small else "unified_exec"),
        "visibility": "list",
        "supported_in_api": True,
        "priority": priority,
        "upgrade": None,
        "base_instructions": SHORT_INSTRUCTIONS if small else LONG_INSTRUCTIONS,
        # Older Codex builds require this field; newer ones read supports_reasoning_summary_parameter.
        "supports_reasoning_summaries": reasoning,
        "supports_reasoning_summary_parameter": reasoning,
        "support_verbosity": False,
        "default_verbosity": None,
        # Kiln runs function tools only: a freeform (custom) apply_patch would be refused.
        "apply_patch_tool_type": None if small else "function",
        "truncation_policy": {"mode": "tokens", "limit": min(max(window // 16, 256), 10_000)},
        "supports_parallel_tool_calls": False,
        "context_window": window,
        "max_context_window": window,
        "auto_compact_token_limit": auto_compact if auto_compact is not None else auto_compact_limit(window),
        "effective_context_window_percent": 95,
        "experimental_supported_tools": [],
        "input_modalities": ["text"],
    }


def catalog(models: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    return {"models": [model_info(m, **kwargs) for m in models]}


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def provider_block(
    *,
    model: str,
    base_url: str,
    catalog_path: Path,
    hosted_tools: str = "reject",
    provider_id: str = "kiln",
    provider_name: str = "Kiln",
    env_key: str = DEFAULT_ENV_KEY,
    context_window: int | None = None,
    websockets: bool = True,
) -> str:
    """The ``config.toml`` lines for Codex (top-level keys first, then the tables)."""
    lines = [
        "# Codex CLI -> Kiln (written by `kiln codex-config`; see docs/codex.md)",
        f"model_provider = {_toml_str(provider_id)}",
        f"model = {_toml_str(model)}",
        f"model_catalog_json = {_toml_str(str(catalog_path))}",
    ]
    if hosted_tools == "drop":
        lines.append("# The gateway drops hosted tools (--hosted-tools drop), so Codex may keep its web_search tool.")
    else:
        lines += [
            "# Kiln answers 400 to hosted tools unless the gateway runs with --hosted-tools drop;",
            "# this removes Codex's web_search tool from its requests.",
            'web_search = "disabled"',
        ]
    lines += [
        "",
        f"[model_providers.{provider_id}]",
    ]
    if provider_name == "OpenAI":
        lines += [
            "# name = \"OpenAI\" turns on Codex's remote compaction: Codex asks Kiln to compact the",
            "# conversation (a compaction_trigger request) instead of summarising it itself.",
        ]
    else:
        lines += [
            "# Setting name = \"OpenAI\" turns on Codex's remote compaction (Kiln compacts the conversation,",
            "# as a compaction_trigger request); any other name makes Codex summarise locally.",
        ]
    lines += [
        f"name = {_toml_str(provider_name)}",
        f"base_url = {_toml_str(base_url.rstrip('/'))}",
        'wire_api = "responses"',
        f"env_key = {_toml_str(env_key)}",
        "# WebSocket mode (docs/websocket.md): one socket per session, each turn sends only its new input.",
        "# Set false (or run the gateway with --websocket off, which Codex answers by using HTTP) to turn it off.",
        f"supports_websockets = {'true' if websockets else 'false'}",
        "",
        "# Sub-agents (the multi_agent_v1 namespace) cost prompt tokens a local model cannot spare.",
        "# Codex 0.169 also accepts `[features] multi_agent = false`, with a deprecation warning.",
        "[agents]",
        "enabled = false",
        "",
    ]
    if context_window is not None and context_window <= SMALL_WINDOW:
        lines += [
            f"# For a window of {context_window} tokens: leave out the goal tools (~900 tokens) and the skills list",
            "# (~250 tokens) that Codex otherwise sends with every request.",
            "[features]",
            "goals = false",
            "",
            "[skills]",
            "include_instructions = false",
            "",
        ]
    return "\n".join(lines)


@click.command("codex-config")
@click.option("--model", "model_id", default=None, help="Model for Codex to use. Default: the first model the gateway serves.")
@click.option("--base-url", default=DEFAULT_BASE_URL, show_default=True, envvar="KILN_BASE_URL", help="The gateway's API base URL, with /v1.")
@click.option("--catalog-out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Where to write the model catalog JSON. Default: $CODEX_HOME/kiln-models.json (~/.codex).")
@click.option("--hosted-tools", type=click.Choice(["reject", "drop"]), default="reject", show_default=True, help="The gateway's --hosted-tools setting: with drop, Codex keeps its web_search tool.")
@click.option("--provider-name", default="Kiln", show_default=True, help='The provider\'s name; "OpenAI" turns on Codex\'s remote compaction through Kiln.')
@click.option("--provider-id", default="kiln", show_default=True, help="The [model_providers.ID] table and model_provider value.")
@click.option("--env-key", default=DEFAULT_ENV_KEY, show_default=True, help="Environment variable Codex reads the API key from (any value for a local gateway).")
@click.option("--auto-compact-limit", type=click.IntRange(min=1), default=None, help="Tokens at which Codex compacts. Default: the window less a quarter (1k..16k) for output.")
@click.option("--shell-type", type=click.Choice(["shell_command", "unified_exec", "local", "default", "disabled"]), default=None,
    help="Codex's shell tool. Default: shell_command for windows up to 32k, else unified_exec.")
@click.option("--websockets/--no-websockets", default=True, show_default=True, help="Write supports_websockets for the provider: Codex then runs each session over one WebSocket.")
def codex_config(
    model_id: str | None, base_url: str, catalog_out: Path | None, hosted_tools: str, provider_name: str, provider_id: str, env_key: str, auto_compact_limit: int | None,
    shell_type: str | None, websockets: bool,
) -> None:
    """Print a Codex CLI provider block for this Kiln and write its model catalog.

    Paste the printed lines into ~/.codex/config.toml (or $CODEX_HOME/config.toml), export the
    ENV_KEY variable (any value unless the gateway runs with --auth keys), and run `codex`.
    """
    try:
        models = fetch_models(base_url, os.environ.get(env_key))
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot list models at {base_url.rstrip('/')}/models: {exc}. Is `kiln serve` running there?") from exc
    if not models:
        raise click.ClickException(f"the gateway at {base_url} serves no models yet (no worker connected); try again when GET /health lists a worker.")
    ids = [m["id"] for m in models]
    if model_id is None:
        model_id = ids[0]
    else:
        match = [m for m in models if model_id == m["id"] or model_id in (m.get("aliases") or [])]
        if not match:
            raise click.ClickException(f"the gateway does not serve {model_id!r}; it serves: {', '.join(ids)}")
        model_id = match[0]["id"]
    # The chosen model first, with the highest priority.
    models.sort(key=lambda m: m["id"] != model_id)
    out = catalog_out or default_codex_home() / "kiln-models.json"
    out = out.expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"models": [model_info(m, shell_type=shell_type, auto_compact=auto_compact_limit, priority=i) for i, m in enumerate(models)]}
    out.write_text(json.dumps(data, indent=2) + "\n")
    click.echo(f"kiln: wrote the model catalog for {', '.join(ids)} to {out}", err=True)
    click.echo(
        provider_block(
            model=model_id,
            base_url=base_url,
            catalog_path=out,
            hosted_tools=hosted_tools,
            provider_id=provider_id,
            provider_name=provider_name,
            env_key=env_key,
            context_window=int(models[0].get("context_window") or 8192),
            websockets=websockets,
        )
    )


if __name__ == "__main__":
    codex_config()
