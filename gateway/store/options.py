"""Command-line flags of the stores, shared by ``kiln-gateway`` and ``kiln serve``.

Each flag reads Kiln's ``KILN_…`` variable and also the name the Responses spec gives it
(``LLAMA_ARG_…`` / ``MLXCEL_…``), so a deployment can switch to Kiln without renaming settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from .backend import STORE_MODES

# (flag, default, spec env var or None, help)
STORE_FLAGS: list[tuple[str, int, str | None, str]] = [
    ("responses-store-max-entries", 1024, "LLAMA_ARG_RESPONSES_STORE_MAX_ENTRIES", "Stored responses kept; 0 turns response persistence off."),
    ("responses-store-max-bytes", 268435456, "MLXCEL_RESPONSES_STORE_MAX_BYTES", "Approximate byte budget of stored responses (and of active background jobs); 0 evicts at once."),
    ("responses-store-ttl-secs", 3600, "LLAMA_ARG_RESPONSES_STORE_TTL_SECS", "Seconds a stored response lives; 0 means no expiry."),
    ("responses-background-max-jobs", 64, "MLXCEL_RESPONSES_BACKGROUND_MAX_JOBS", "Background responses running at once; 0 turns background mode off."),
    ("responses-background-ephemeral-ttl-secs", 600, "MLXCEL_RESPONSES_BACKGROUND_EPHEMERAL_TTL_SECS", "Seconds a finished store:false background response stays readable (at least 1)."),
    ("responses-background-lease-secs", 30, None, "With --store redis: a background job whose replica stops renewing its lease ends failed within this many seconds (at least 1)."),
    ("conversation-store-max-entries", 256, "LLAMA_ARG_CONVERSATION_STORE_MAX_ENTRIES", "Conversation transcripts kept; 0 turns conversations off."),
    ("conversation-store-max-bytes", 67108864, "MLXCEL_CONVERSATION_STORE_MAX_BYTES", "Approximate byte budget of transcripts; 0 evicts at once."),
    ("conversation-store-ttl-secs", 3600, "LLAMA_ARG_CONVERSATION_STORE_TTL_SECS", "Seconds a transcript lives; 0 means no expiry."),
]


def _kiln_env(flag: str) -> str:
    return "KILN_" + flag.upper().replace("-", "_")


def store_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for flag, default, spec_env, help_text in reversed(STORE_FLAGS):
        envvars = [_kiln_env(flag)] + ([spec_env] if spec_env else [])
        func = click.option(
            f"--{flag}",
            type=click.IntRange(min=0),
            default=default,
            show_default=True,
            envvar=envvars,
            help=f"{help_text} [env: {', '.join(envvars)}]",
        )(func)
    func = click.option(
        "--store",
        "store_mode",
        type=click.Choice(list(STORE_MODES)),
        default="memory",
        show_default=True,
        envvar="KILN_STORE",
        help="memory: keep responses as the Responses API describes, in this process. redis: the same, shared by every gateway replica through --redis-url. none: the hosted contract's store-less gateway.",
    )(func)
    return func


def store_settings(options: dict[str, Any]) -> dict[str, Any]:
    """Pop the store options out of a click options dict, as Settings keyword arguments."""
    values = {flag.replace("-", "_"): options.pop(flag.replace("-", "_")) for flag, *_ in STORE_FLAGS}
    values["store_mode"] = options.pop("store_mode")
    if values["responses_background_ephemeral_ttl_secs"] < 1:
        raise click.BadParameter(
            "must be at least 1: finished store:false background responses need a time to stay readable",
            param_hint="--responses-background-ephemeral-ttl-secs",
        )
    if values["responses_background_lease_secs"] < 1:
        raise click.BadParameter("must be at least 1", param_hint="--responses-background-lease-secs")
    return values


def store_args(options: dict[str, Any]) -> list[str]:
    """The same options as command-line arguments for a child gateway (``kiln serve``)."""
    args = ["--store", options["store_mode"]]
    for flag, *_ in STORE_FLAGS:
        args += [f"--{flag}", str(options[flag.replace("-", "_")])]
    return args
