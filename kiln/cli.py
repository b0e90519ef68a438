"""``kiln``: the umbrella command (serve, and the admin commands)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from kiln.gateway.cli import checked
from kiln.gateway.settings import Settings
from kiln.protocol.logs import configure
from kiln.protocol.settings_fields import child_env, env_names, from_options, settings_options, to_argv
from kiln.worker.cli import served_names
from kiln.worker.settings import WorkerSettings

from .settings import DECIDED_FLAGS, ServeSettings


class LazyGroup(click.Group):
    """A group whose other commands are imported when named, not on every ``kiln serve``.

    Why: ``kiln.admin`` imports the accounts database (SQLAlchemy, ~0.3 s) and ``codex-config``
    httpx (~0.1 s), which ``kiln serve`` never needs; importing them on every start delayed the
    spawn of the gateway and the workers, so the time until the model is served, by that much."""

    lazy = {"orgs": "kiln.admin:orgs", "keys": "kiln.admin:keys", "codex-config": "kiln.codex_config:codex_config", "models": "kiln.models_cli:models"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module, name = self.lazy[cmd_name].split(":")
            command: click.Command = getattr(importlib.import_module(module), name)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """Kiln: the OpenAI Responses API for models you host."""


@main.command()
@settings_options(ServeSettings, Settings, WorkerSettings, exclude=DECIDED_FLAGS)
def serve(**options: Any) -> None:
    """Start a gateway and WORKERS workers; restart workers that die; stop all on Ctrl-C.

    Takes every kiln-gateway and kiln-worker setting (flag or KILN_... variable) and hands it to the
    children: on their command line, secrets in their environment (never argv, which `ps` shows).
    """
    from kiln.protocol.security import SecretError, generate_secret, load_secret

    from .supervisor import build, health_url

    own = from_options(ServeSettings, options)
    configure(options["log_level"])
    worker = from_options(WorkerSettings, options)
    count = own.workers
    served = None
    if own.config_path:
        from kiln.protocol.model_config import ConfigError, load_config

        if worker.model or worker.model_alias:
            raise click.UsageError("--config names the models: drop --model/--model-alias")
        try:
            served = load_config(own.config_path).models
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc
        count = sum(m.workers for m in served)
    # Gateway and workers authenticate each other with a secret of their own, unless the user set
    # one, e.g. for workers on other hosts.
    try:
        secret = load_secret(options["worker_secret"], options["worker_secret_file"]) or generate_secret()
    except SecretError as exc:
        raise click.BadParameter(str(exc), param_hint="--worker-secret") from exc
    secrets: dict[str, Any] = {"worker_secret": secret, "worker_secret_file": None}
    sealing: dict[str, str] = {}
    if not options["secret_key"]:
        # Reasoning sealed by this server stays readable after a restart (kiln/state.py).
        from .state import StateError, default_data_dir, sealing_key

        try:
            sealing["secret_key"] = sealing_key(Path(own.data_dir).expanduser() if own.data_dir else default_data_dir())
        except StateError as exc:
            raise click.BadParameter(str(exc), param_hint="--data-dir") from exc
    runtime = private_runtime_dir()
    try:
        bind = own.workers_bind or f"ipc://{runtime}/workers.sock"
        names = None
        config: str | None
        if served is None:
            # The gateway knows the model from the start (503 "model_loading" until its worker
            # is up, never 404): the command line's model, as a config file of one model.
            names = served_names(worker)
            config = write_config(Path(runtime), names, worker.model, count)
        else:
            config = own.config_path
        # Checked whole (hosted settings, files read) before anything starts.
        gateway = checked(from_options(Settings, {**options, "workers_bind": bind, "config_path": config, **secrets, **sealing}))
        worker = replace(worker, gateway=(bind.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1"),), **secrets)
        base = {k: v for k, v in os.environ.items() if k not in env_names([ServeSettings, Settings, WorkerSettings])}
        worker_env = child_env(worker, base)
        # Workers share the cores: each gets its share of BLAS threads unless the user chose.
        worker_env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, count))))
        if worker.engine == "mlx":
            from kiln.worker.loading.blas import with_openblas

            worker_env = with_openblas(worker_env)  # preloaded here: the workers need not re-execute
        on_demand: dict[str, list[tuple[str, list[str]]]] = {}
        if served is None:
            workers = [(f"worker-{i}", to_argv(worker)) for i in range(count)]
        else:
            # Each model's workers get its settings from the file on their command line (already
            # checked here), not the file itself, so a restart runs what was checked.
            specs = {m.id: [(f"worker-{m.id.replace('/', '_')}-{i}", to_argv(replace(worker, config_path=None, **m.worker_settings()))) for i in range(m.workers)] for m in served}
            workers = [spec for m in served if not m.on_demand for spec in specs[m.id]]
            on_demand = {m.id: specs[m.id] for m in served if m.on_demand}
        # On stdout: stderr is the JSON log (one object per line, for jq and log shippers).
        later = f" (+{sum(len(v) for v in on_demand.values())} on demand)" if on_demand else ""
        click.echo(f"kiln: starting on http://{gateway.host}:{gateway.port}/v1 with {len(workers)} worker(s){later}; requests answer 503 model_loading until the model is loaded; Ctrl-C stops")
        if names is not None:
            model = names[0]
        else:
            assert served is not None
            model = next((m.id for m in served if not m.on_demand), served[0].id)
        supervisor = build(gateway_args=to_argv(gateway), gateway_env=child_env(gateway, base), workers=workers, worker_env=worker_env, health_url=health_url(gateway.host, gateway.port),
            on_demand=on_demand, ready_line=try_line(gateway, model))
        code = supervisor.run()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    raise SystemExit(code)


def write_config(directory: Path, names: tuple[str, list[str]], source: str | None, workers: int) -> str:
    """A kiln.toml of the one model on the command line, for the gateway (``--config``): its id and
    aliases as the worker will register them. TOML basic strings take JSON's escapes."""
    model_id, aliases = names
    lines = ["[[models]]", f"id = {json.dumps(model_id)}", f"source = {json.dumps(source or model_id)}", f"aliases = {json.dumps([a for a in aliases if a != model_id])}", f"workers = {workers}"]
    path = directory / "models.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def try_line(gateway: Settings, model: str) -> str:
    """The request the ready line suggests: one that works as it is (hosted mode needs a key)."""
    from .supervisor import health_url

    base = health_url(gateway.host, gateway.port).removesuffix("/health")
    body = json.dumps({"model": model, "input": "Say hello"})
    key = ' -H "Authorization: Bearer $KILN_API_KEY"' if gateway.auth == "keys" else ""
    return f"try: curl {base}/v1/responses -H 'Content-Type: application/json'{key} -d '{body}'"


def private_runtime_dir() -> str:
    """A directory only this user can enter (0700), for this server's gateway-worker socket:
    under $XDG_RUNTIME_DIR when set, else the temp folder, with a short path (ipc:// paths are
    limited to about 100 bytes)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.path.isdir(base) or len(base) > 60:
        base = None
    return tempfile.mkdtemp(prefix="kiln-", dir=base)
