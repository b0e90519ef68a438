"""``kiln``: the umbrella command (serve, and the admin commands)."""

from __future__ import annotations

import click

from .logs import configure


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """Kiln: the OpenAI Responses API for models you host."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, envvar="KILN_HOST", help="HTTP address to listen on.")
@click.option("--port", default=8080, show_default=True, type=int, envvar="KILN_PORT", help="HTTP port.")
@click.option("--model", default=None, envvar="KILN_MODEL", help="GGUF file or mlx-lm folder. Default: the bundled SmolLM2-135M-Instruct.")
@click.option("--model-alias", multiple=True, envvar="KILN_MODEL_ALIAS", help="Another name for the model (repeatable).")
@click.option("--workers", default=1, show_default=True, type=int, envvar="KILN_WORKERS", help="Worker processes to start (each loads the model).")
@click.option("--workers-bind", default="tcp://127.0.0.1:5555", show_default=True, envvar="KILN_WORKERS_BIND", help="ZeroMQ address between gateway and workers.")
@click.option("--engine", type=click.Choice(["mlx", "scripted"]), default="mlx", show_default=True, envvar="KILN_ENGINE", help="scripted: weightless engine for tests and overhead benchmarks.")
@click.option("--log-level", default="warning", show_default=True, envvar="KILN_LOG_LEVEL", help="debug, info, warning or error.")
def serve(host: str, port: int, model: str | None, model_alias: tuple[str, ...], workers: int, workers_bind: str, engine: str, log_level: str) -> None:
    """Start a gateway and WORKERS workers; restart workers that die; stop all on Ctrl-C.

    Every other gateway and worker setting reaches the children through its KILN_... environment
    variable (see `kiln-gateway --help` and `kiln-worker --help`).
    """
    from .supervisor import build

    configure(log_level)
    gateway_args = ["--host", host, "--port", str(port), "--workers-bind", workers_bind, "--log-level", log_level]
    worker_args = ["--gateway", workers_bind.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1"), "--engine", engine, "--log-level", log_level]
    if model:
        worker_args += ["--model", model]
    for alias in model_alias:
        worker_args += ["--model-alias", alias]
    click.echo(f"kiln: serving on http://{host}:{port}/v1 with {workers} worker(s); Ctrl-C stops", err=True)
    raise SystemExit(build(gateway_args=gateway_args, worker_args=worker_args, workers=workers).run())
