"""``kiln-gateway``: the HTTP front of Kiln."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import replace
from typing import Any, cast

import click

from kiln.protocol.logs import configure
from kiln.protocol.security import is_loopback_host
from kiln.protocol.settings_fields import from_options, settings_options

from .settings import Settings


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@settings_options(Settings)
def main(**options: Any) -> None:
    """Serve the OpenAI Responses API and route requests to kiln-worker processes."""
    settings = from_options(Settings, options)
    configure(settings.log_level)
    serve(checked(settings))


def public_bind_refusal(host: str, auth: str, allow_public_no_auth: bool) -> str | None:
    """The message to refuse starting with, or None when the combination is safe (or allowed)."""
    if auth != "none" or allow_public_no_auth or is_loopback_host(host):
        return None
    return (
        f"refusing to listen on {host} with --auth none: anyone who can reach this address could use "
        "the models. Use --auth keys (with --database-url) for a public gateway, bind 127.0.0.1, or "
        "pass --allow-public-no-auth (env KILN_ALLOW_PUBLIC_NO_AUTH=1) if the network in front of it "
        "already restricts access."
    )


def checked(settings: Settings) -> Settings:
    """`settings` with the files it names read (admin token, worker secret), refused with a usage
    error naming the flag when fields do not go together. ``kiln serve`` runs it too, before
    anything starts, and hands the gateway the result."""
    refusal = public_bind_refusal(settings.host, settings.auth, settings.allow_public_no_auth)
    if refusal:
        raise click.UsageError(refusal)
    if settings.auth == "keys":
        from .accounts.db import async_url  # SQLAlchemy: imported where a database is named

        if not settings.database_url:
            raise click.UsageError("--auth keys needs --database-url (env KILN_DATABASE_URL)")
        try:
            async_url(settings.database_url)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--database-url") from exc
    if settings.advertise_workers and not settings.redis_url:
        raise click.UsageError("--advertise-workers needs --redis-url (env KILN_REDIS_URL): the address is advertised there")
    if settings.store_mode == "redis" and not settings.redis_url:
        raise click.UsageError("--store redis needs --redis-url (env KILN_REDIS_URL)")
    if settings.catalog_path:
        from .accounts.catalog import Catalog, CatalogError

        try:
            Catalog.load(settings.catalog_path)
        except (CatalogError, OSError, ValueError) as exc:
            raise click.BadParameter(str(exc), param_hint="--catalog") from exc
        settings = replace(settings, catalog_path=os.path.abspath(settings.catalog_path))
    if settings.config_path:
        from kiln.protocol.model_config import ConfigError, load_config

        try:
            load_config(settings.config_path)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--config") from exc
        settings = replace(settings, config_path=os.path.abspath(settings.config_path))
    if settings.supervisor_fd is not None:
        from .pool.supervisor_link import check_fd

        problem = check_fd(settings.supervisor_fd)
        if problem:
            raise click.BadParameter(problem, param_hint="--supervisor-fd")
    token = admin_token(settings.admin_token, settings.admin_token_file)
    secret = worker_secret(settings.workers_bind, settings.worker_secret, settings.worker_secret_file, settings.allow_unauthenticated_workers)
    return replace(settings, admin_token=token, admin_token_file=None, worker_secret=secret, worker_secret_file=None)


def admin_token(token: str | None, token_file: str | None) -> str | None:
    """The admin token from --admin-token / KILN_ADMIN_TOKEN or --admin-token-file /
    KILN_ADMIN_TOKEN_FILE (one of them); a token given as a flag is visible in `ps`, so warn."""
    from kiln.protocol.logs import warn_secret_on_command_line

    if token_file:
        if token:
            raise click.UsageError("give the admin token once: --admin-token (KILN_ADMIN_TOKEN) or --admin-token-file (KILN_ADMIN_TOKEN_FILE)")
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError):
            raise click.BadParameter("cannot read the admin token file", param_hint="--admin-token-file") from None
        if not token:
            raise click.BadParameter("the admin token file is empty", param_hint="--admin-token-file")
        return token
    ctx = click.get_current_context(silent=True)
    if token and ctx is not None and ctx.get_parameter_source("admin_token") == click.core.ParameterSource.COMMANDLINE:
        warn_secret_on_command_line("--admin-token", "--admin-token-file or KILN_ADMIN_TOKEN")
    return token or None


def worker_secret(workers_bind: str, value: str | None, path: str | None, allow_unauthenticated: bool = False) -> str | None:
    """The worker secret, checked; refuses a worker socket other hosts can reach without one, and
    any other without one unless the operator allowed unauthenticated workers."""
    from kiln.protocol.security import SecretError, is_local_endpoint, load_secret

    try:
        secret = load_secret(value, path)
    except SecretError as exc:
        raise click.BadParameter(str(exc), param_hint="--worker-secret") from exc
    if secret is None and not is_local_endpoint(workers_bind):
        raise click.UsageError(
            f"--workers-bind {workers_bind} can be reached from other hosts, and without a worker secret any "
            "process there could register as a worker. Set --worker-secret-file (or KILN_WORKER_SECRET) on the "
            "gateway and on every worker, or bind a loopback (tcp://127.0.0.1:PORT) or ipc:// address."
        )
    if secret is None and not allow_unauthenticated:
        raise click.UsageError(
            "without a worker secret any local process could register as a worker, read every request and "
            "report usage. Set --worker-secret-file (or KILN_WORKER_SECRET) on the gateway and on every worker "
            "(`kiln serve` does this for its own workers), or pass --allow-unauthenticated-workers."
        )
    return secret


def serve(settings: Settings) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config
    from hypercorn.typing import ASGIFramework

    from .http.app import create_app

    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.accesslog = None
    # Hypercorn's error log through kiln.protocol.logs' JSON handler: "-" would add a plain-text handler
    # of its own that printed every traceback a second time, not as JSON.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.loglevel = "WARNING"
    # Hypercorn's own bounds, for what happens before a request reaches the app: the idle timer
    # runs from accept until a request's headers are complete and between keep-alive requests, so
    # it also closes half-open and header-dribbling connections; headers past 16 KiB get 400.
    # read_timeout stays off: it would also cut long streams whose client is silent by design.
    # Bodies are bounded by the edge middleware (--body-timeout) instead.
    config.keep_alive_timeout = settings.keep_alive_timeout_s
    config.h11_max_incomplete_size = 16 * 1024
    config.h2_max_concurrent_streams = 100
    config.backlog = 1024
    # WebSocket mode: a frame is bounded like an HTTP body; server pings keep idle sockets alive.
    config.websocket_max_message_size = settings.max_body_bytes
    config.websocket_ping_interval = settings.websocket_ping_interval_s or None
    app = create_app(settings)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # Starlette's ASGI types are looser than Hypercorn's (MutableMapping scopes, not TypedDicts).
        await hypercorn_serve(cast(ASGIFramework, app), config, shutdown_trigger=stop.wait)

    asyncio.run(run())
