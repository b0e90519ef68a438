"""``kiln-gateway``: the HTTP front of Kiln."""

from __future__ import annotations

import asyncio
import signal

import click

from kiln.logs import configure

from .settings import Settings


def _env(*names: str) -> list[str]:
    return list(names)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--host", default="127.0.0.1", show_default=True, envvar="KILN_HOST", help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=int, envvar="KILN_PORT", help="HTTP port.")
@click.option("--workers-bind", default="tcp://127.0.0.1:5555", show_default=True, envvar="KILN_WORKERS_BIND", help="ZeroMQ address workers connect to.")
@click.option("--max-body-bytes", default=32 << 20, show_default=True, type=int, envvar="KILN_MAX_BODY_BYTES", help="Largest request body accepted; larger ones get 413.")
@click.option("--heartbeat-timeout", default=5.0, show_default=True, type=float, envvar="KILN_HEARTBEAT_TIMEOUT", help="Seconds of worker silence before its requests are failed.")
@click.option("--hosted-tools", type=click.Choice(["reject", "drop"]), default="reject", show_default=True, envvar="KILN_HOSTED_TOOLS", help="Hosted tool types (web_search, ...): answer 400, or drop them from the request.")
@click.option("--log-level", default="warning", show_default=True, envvar="KILN_LOG_LEVEL", help="debug, info, warning or error.")
def main(host: str, port: int, workers_bind: str, max_body_bytes: int, heartbeat_timeout: float, hosted_tools: str, log_level: str) -> None:
    """Serve the OpenAI Responses API and route requests to kiln-worker processes."""
    configure(log_level)
    settings = Settings(
        host=host,
        port=port,
        workers_bind=workers_bind,
        max_body_bytes=max_body_bytes,
        heartbeat_timeout_s=heartbeat_timeout,
        hosted_tools=hosted_tools,
    )
    serve(settings)


def serve(settings: Settings) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from .app import create_app

    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.accesslog = None
    config.errorlog = "-"
    config.loglevel = "WARNING"
    config.keep_alive_timeout = 75
    app = create_app(settings)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await hypercorn_serve(app, config, shutdown_trigger=stop.wait)

    asyncio.run(run())
