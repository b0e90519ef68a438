"""``kiln-gateway``: the HTTP front of Kiln."""

from __future__ import annotations

import asyncio
import logging
import signal

import click

from kiln.protocol.logs import configure
from kiln.protocol import DEFAULT_WORKERS_ADDRESS

from .settings import Settings
from .store.options import store_options, store_settings


def _env(*names: str) -> list[str]:
    return list(names)


def hosted_options(func):
    """The hosted-mode flags (docs/hosted.md), shared by ``kiln-gateway`` and ``kiln serve``."""
    for option in reversed([
        click.option("--auth", type=click.Choice(["none", "keys"]), default="none", show_default=True, envvar="KILN_AUTH", help="keys: API keys per organization, metering, credits and concurrency limits (needs --database-url)."),
        click.option("--database-url", default=None, envvar="KILN_DATABASE_URL", help="Accounts database: sqlite:///PATH or postgresql://USER@HOST/DB."),
        click.option("--catalog", "catalog_path", default=None, type=click.Path(exists=True, dir_okay=False), envvar="KILN_CATALOG", help="TOML model catalog with prices; other models get 404 model_not_found. Without it every served model is free."),
        click.option("--redis-url", default=None, envvar="KILN_REDIS_URL", help="Redis shared by gateway replicas: per-organization concurrency and the maintenance switch (--auth keys), the stores (--store redis). Default: in-process."),
        click.option("--redis-namespace", default="kiln", show_default=True, envvar="KILN_REDIS_NAMESPACE", help="Key prefix in Redis; replicas of one deployment share it."),
        click.option("--admin-token", default=None, envvar="KILN_ADMIN_TOKEN", help="Bearer token for /admin/maintenance (off without it)."),
        click.option("--allow-public-no-auth", is_flag=True, default=False, envvar="KILN_ALLOW_PUBLIC_NO_AUTH", help="Allow --auth none on a non-loopback address."),
        click.option("--admin-token-file", default=None, type=click.Path(exists=True, dir_okay=False), envvar="KILN_ADMIN_TOKEN_FILE", help="File holding the admin token (kept out of `ps`, unlike --admin-token)."),
    ]):
        func = option(func)
    return func


def hosted_settings(host: str, options: dict) -> dict:
    """Pop the hosted options out of a click options dict, checked, as Settings keyword arguments."""
    from .accounts.catalog import CatalogError, Catalog
    from .accounts.db import async_url
    from .accounts.service import public_bind_refusal

    values = {name: options.pop(name) for name in ("auth", "database_url", "catalog_path", "redis_url", "redis_namespace", "admin_token", "allow_public_no_auth")}
    values["admin_token"] = admin_token(values["admin_token"], options.pop("admin_token_file", None))
    refusal = public_bind_refusal(host, values["auth"], values["allow_public_no_auth"])
    if refusal:
        raise click.UsageError(refusal)
    if values["auth"] == "keys":
        if not values["database_url"]:
            raise click.UsageError("--auth keys needs --database-url (env KILN_DATABASE_URL)")
        try:
            async_url(values["database_url"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--database-url")
    if values["catalog_path"]:
        try:
            Catalog.load(values["catalog_path"])
        except (CatalogError, OSError, ValueError) as exc:
            raise click.BadParameter(str(exc), param_hint="--catalog")
    return values


def edge_options(func):
    """The HTTP edge flags (gateway/edge.py; docs/configuration.md)."""
    for option in reversed([
        click.option("--body-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0), envvar="KILN_BODY_TIMEOUT", help="Seconds a request body may take to arrive; slower ones get 408 and the connection is closed. 0: no bound."),
        click.option("--body-buffer-bytes", default=256 << 20, show_default=True, type=click.IntRange(min=0), envvar="KILN_BODY_BUFFER_BYTES", help="Bytes of request bodies still arriving, over all requests; a chunk past it gets 503 with Retry-After. 0: no bound."),
        click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(min=0), envvar="KILN_MAX_CONNECTIONS", help="HTTP requests served at once (streams included); beyond it, 503 with Retry-After. 0: no cap."),
        click.option("--keep-alive-timeout", default=75.0, show_default=True, type=click.FloatRange(min=0, min_open=True), envvar="KILN_KEEP_ALIVE_TIMEOUT", help="Seconds an idle connection stays open, and the most a client may take to send its request headers."),
        click.option("--allowed-hosts", default=None, envvar="KILN_ALLOWED_HOSTS", help="Comma list of Host names accepted besides loopback ones (* = any). Default: loopback names only when listening on loopback with --auth none, else any."),
        click.option("--websocket", type=click.Choice(["on", "off"]), default="on", show_default=True, envvar="KILN_WEBSOCKET", help="WebSocket mode on /v1/responses; off answers the upgrade with 426 so clients use HTTP."),
        click.option("--cors-origins", default=None, envvar="KILN_CORS_ORIGINS", help="Comma list of web origins (https://app.example) allowed to call the API from a browser (* = any)."),
    ]):
        func = option(func)
    return func


def edge_settings(options: dict) -> dict:
    """Pop the edge options out of a click options dict, as Settings keyword arguments."""
    from .edge import split_list

    return {
        "body_timeout_s": options.pop("body_timeout"),
        "body_buffer_bytes": options.pop("body_buffer_bytes"),
        "max_connections": options.pop("max_connections"),
        "keep_alive_timeout_s": options.pop("keep_alive_timeout"),
        "allowed_hosts": split_list(options.pop("allowed_hosts")),
        "cors_origins": split_list(options.pop("cors_origins")),
        "websocket": options.pop("websocket"),
    }
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
            raise click.BadParameter("cannot read the admin token file", param_hint="--admin-token-file")
        if not token:
            raise click.BadParameter("the admin token file is empty", param_hint="--admin-token-file")
        return token
    ctx = click.get_current_context(silent=True)
    if token and ctx is not None and ctx.get_parameter_source("admin_token") == click.core.ParameterSource.COMMANDLINE:
        warn_secret_on_command_line("--admin-token", "--admin-token-file or KILN_ADMIN_TOKEN")
    return token or None


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--host", default="127.0.0.1", show_default=True, envvar="KILN_HOST", help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=int, envvar="KILN_PORT", help="HTTP port.")
@click.option("--workers-bind", default=DEFAULT_WORKERS_ADDRESS, show_default=True, envvar="KILN_WORKERS_BIND", help="ZeroMQ address workers connect to.")
@click.option("--max-body-bytes", default=32 << 20, show_default=True, type=int, envvar="KILN_MAX_BODY_BYTES", help="Largest request body accepted; larger ones get 413.")
@click.option("--heartbeat-timeout", default=5.0, show_default=True, type=float, envvar="KILN_HEARTBEAT_TIMEOUT", help="Seconds of worker silence before its requests are failed.")
@click.option("--first-event-timeout", default=300.0, show_default=True, type=click.FloatRange(min=0, min_open=True), envvar="KILN_FIRST_EVENT_TIMEOUT", help="Seconds a worker may take to start answering a request (queueing, prefill, compaction) before it fails with 504.")
@click.option("--event-timeout", default=60.0, show_default=True, type=click.FloatRange(min=0, min_open=True), envvar="KILN_EVENT_TIMEOUT", help="Seconds a worker may stay silent between two events of a request before it fails with 504.")
@click.option("--hosted-tools", type=click.Choice(["reject", "drop"]), default="reject", show_default=True, envvar="KILN_HOSTED_TOOLS", help="Hosted tool types (web_search, ...): answer 400, or drop them from the request.")
@click.option("--log-level", default="warning", show_default=True, envvar="KILN_LOG_LEVEL", help="debug, info, warning or error.")
@click.option("--secret-key", default=None, envvar="KILN_SECRET_KEY", help="Key that signs reasoning and compaction content handed to clients. Set the same key on every gateway replica; default: random per process.")
@click.option("--reasoning-echo-max-bytes", default=16 << 20, show_default=True, type=click.IntRange(min=0), envvar=["KILN_REASONING_ECHO_MAX_BYTES", "MLXCEL_REASONING_ECHO_MAX_BYTES"], help="Byte budget of the reasoning echo store; 0 turns it off.")
@click.option("--default-temperature", default=None, type=click.FloatRange(0, 2), envvar="KILN_DEFAULT_TEMPERATURE", help="Temperature for requests that do not set one (default: 1, as OpenAI). Small models ramble less at 0-0.7; clients such as Codex never send one.")
@store_options
@hosted_options
@click.option("--worker-secret", default=None, envvar="KILN_WORKER_SECRET", help="Shared secret workers must hold to connect (ZeroMQ CURVE, encrypted). Required for a --workers-bind other hosts can reach.")
@click.option("--worker-secret-file", default=None, type=click.Path(dir_okay=False), envvar="KILN_WORKER_SECRET_FILE", help="Read --worker-secret from this file, so it never shows in `ps`.")
@edge_options
def main(host: str, port: int, workers_bind: str, max_body_bytes: int, heartbeat_timeout: float, hosted_tools: str, log_level: str, **options) -> None:
    """Serve the OpenAI Responses API and route requests to kiln-worker processes."""
    configure(log_level)
    stores = store_settings(options)
    stores["secret_key"] = options.pop("secret_key")
    stores["reasoning_echo_max_bytes"] = options.pop("reasoning_echo_max_bytes")
    default_temperature = options.pop("default_temperature")
    timeouts = {"first_event_timeout_s": options.pop("first_event_timeout"), "event_timeout_s": options.pop("event_timeout")}
    hosted = hosted_settings(host, options)
    if stores["store_mode"] == "redis" and not hosted["redis_url"]:
        raise click.UsageError("--store redis needs --redis-url (env KILN_REDIS_URL)")
    worker_secret = worker_secret_setting(workers_bind, options.pop("worker_secret"), options.pop("worker_secret_file"))
    edge = edge_settings(options)
    settings = Settings(
        host=host,
        port=port,
        workers_bind=workers_bind,
        max_body_bytes=max_body_bytes,
        heartbeat_timeout_s=heartbeat_timeout,
        hosted_tools=hosted_tools,
        default_temperature=default_temperature,
        **timeouts,
        **stores,
        **hosted,
        worker_secret=worker_secret,
        **edge,
    )
    serve(settings)


def worker_secret_setting(workers_bind: str, value: str | None, path: str | None) -> str | None:
    """The worker secret, checked; refuses a worker socket other hosts can reach without one."""
    from kiln.protocol.security import SecretError, is_local_endpoint, load_secret

    try:
        secret = load_secret(value, path)
    except SecretError as exc:
        raise click.BadParameter(str(exc), param_hint="--worker-secret")
    if secret is None and not is_local_endpoint(workers_bind):
        raise click.UsageError(
            f"--workers-bind {workers_bind} can be reached from other hosts, and without a worker secret any "
            "process there could register as a worker. Set --worker-secret-file (or KILN_WORKER_SECRET) on the "
            "gateway and on every worker, or bind a loopback (tcp://127.0.0.1:PORT) or ipc:// address."
        )
    return secret


def serve(settings: Settings) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from .app import create_app

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
        await hypercorn_serve(app, config, shutdown_trigger=stop.wait)

    asyncio.run(run())
