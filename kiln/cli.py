"""``kiln``: the umbrella command (serve, and the admin commands)."""

from __future__ import annotations

import os
import shutil
import tempfile

import click

from kiln.gateway.cli import hosted_options, hosted_settings
from kiln.gateway.store.options import store_args, store_options, store_settings

from .admin import keys, orgs
from .codex_config import codex_config
from .models_cli import models
from kiln.protocol.logs import configure

# Hosted settings reach the gateway child as environment variables (not argv, where a database
# password or the admin token would show in `ps`).
_HOSTED_ENV = {
    "auth": "KILN_AUTH",
    "database_url": "KILN_DATABASE_URL",
    "catalog_path": "KILN_CATALOG",
    "redis_url": "KILN_REDIS_URL",
    "redis_namespace": "KILN_REDIS_NAMESPACE",
    "admin_token": "KILN_ADMIN_TOKEN",
    "allow_public_no_auth": "KILN_ALLOW_PUBLIC_NO_AUTH",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """Kiln: the OpenAI Responses API for models you host."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, envvar="KILN_HOST", help="HTTP address to listen on.")
@click.option("--port", default=8080, show_default=True, type=int, envvar="KILN_PORT", help="HTTP port.")
@click.option("--model", default=None, envvar="KILN_MODEL", help="GGUF file or mlx-lm folder. Default: the bundled SmolLM2-135M-Instruct.")
@click.option("--model-alias", multiple=True, envvar="KILN_MODEL_ALIAS", help="Another name for the model (repeatable).")
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False), envvar="KILN_CONFIG", help="A kiln.toml with [[models]] tables: several models, each with its own workers (replaces --model, --model-alias and --workers).")
@click.option("--workers", default=1, show_default=True, type=int, envvar="KILN_WORKERS", help="Worker processes to start (each loads the model).")
@click.option("--workers-bind", default=None, envvar="KILN_WORKERS_BIND", help="ZeroMQ address between gateway and workers. Default: a private ipc:// socket of this server, so several servers on one machine never collide.")
@click.option("--engine", type=click.Choice(["mlx", "scripted"]), default="mlx", show_default=True, envvar="KILN_ENGINE", help="scripted: weightless engine for tests and overhead benchmarks.")
@click.option("--hosted-tools", type=click.Choice(["reject", "drop"]), default="reject", show_default=True, envvar="KILN_HOSTED_TOOLS", help="Hosted tool types (web_search, ...): answer 400, or drop them from the request.")
@click.option("--log-level", default="warning", show_default=True, envvar="KILN_LOG_LEVEL", help="debug, info, warning or error.")
@store_options
@hosted_options
def serve(host: str, port: int, model: str | None, model_alias: tuple[str, ...], config_path: str | None, workers: int, workers_bind: str | None, engine: str, hosted_tools: str, log_level: str, **hosted_opts) -> None:
    """Start a gateway and WORKERS workers; restart workers that die; stop all on Ctrl-C.

    Every other gateway and worker setting reaches the children through its KILN_... environment
    variable (see `kiln-gateway --help` and `kiln-worker --help`).
    """
    from .supervisor import build

    configure(log_level)
    models = None
    if config_path:
        from .config import ConfigError, load_config

        if model or model_alias:
            raise click.UsageError("--config names the models: drop --model/--model-alias")
        try:
            config = load_config(config_path)
        except ConfigError as exc:
            raise click.UsageError(str(exc))
        models = [(m.id.replace("/", "_"), m.worker_args(), m.workers) for m in config.models]
        workers = sum(m.workers for m in config.models)
    store_opts = {k: hosted_opts.pop(k) for k in list(hosted_opts) if k == "store_mode" or k.startswith(("responses_", "conversation_"))}
    store_settings(dict(store_opts))  # validates (e.g. the ephemeral TTL) before anything starts
    for name, value in hosted_settings(host, hosted_opts).items():
        if name == "catalog_path" and value:
            value = os.path.abspath(value)
        if value in (None, False):
            os.environ.pop(_HOSTED_ENV[name], None)
        else:
            os.environ[_HOSTED_ENV[name]] = "1" if value is True else str(value)
    if store_opts["store_mode"] == "redis" and not os.environ.get("KILN_REDIS_URL"):
        raise click.UsageError("--store redis needs --redis-url (env KILN_REDIS_URL)")
    # The token file was read above; the gateway gets the token alone (KILN_ADMIN_TOKEN), not both.
    os.environ.pop("KILN_ADMIN_TOKEN_FILE", None)
    runtime = None
    if workers_bind is None:
        runtime = private_runtime_dir()
        workers_bind = f"ipc://{runtime}/workers.sock"
    gateway_args = ["--host", host, "--port", str(port), "--workers-bind", workers_bind, "--hosted-tools", hosted_tools, "--log-level", log_level, *store_args(store_opts)]
    # Gateway and workers authenticate each other with a secret of their own (by environment, not
    # argv, where `ps` shows it), unless the user set one, e.g. for workers on other hosts.
    from kiln.protocol.security import generate_secret, secret_from_env

    if not secret_from_env():
        os.environ["KILN_WORKER_SECRET"] = generate_secret()
    # Workers share the cores: each gets its share of BLAS threads unless the user chose.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, workers))))
    worker_args = ["--gateway", workers_bind.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1"), "--engine", engine, "--log-level", log_level]
    if model:
        worker_args += ["--model", model]
    for alias in model_alias:
        worker_args += ["--model-alias", alias]
    # On stdout: stderr is the JSON log (one object per line, for jq and log shippers).
    click.echo(f"kiln: serving on http://{host}:{port}/v1 with {workers} worker(s); Ctrl-C stops")
    try:
        code = build(gateway_args=gateway_args, worker_args=worker_args, workers=workers, models=models).run()
    finally:
        if runtime is not None:
            shutil.rmtree(runtime, ignore_errors=True)
    raise SystemExit(code)


def private_runtime_dir() -> str:
    """A directory only this user can enter (0700), for this server's gateway-worker socket:
    under $XDG_RUNTIME_DIR when set, else the temp folder, with a short path (ipc:// paths are
    limited to about 100 bytes)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.path.isdir(base) or len(base) > 60:
        base = None
    return tempfile.mkdtemp(prefix="kiln-", dir=base)


main.add_command(orgs)
main.add_command(keys)
main.add_command(codex_config)
main.add_command(models)
