"""``kiln serve`` takes every gateway and worker flag and gives each child exactly the settings it
parsed: non-secret ones on the child's command line, secrets in its environment. In process: the
supervisor is replaced by a recorder, and each child's argv and environment are parsed back with the
daemon's own command."""

from __future__ import annotations

import shutil
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

import kiln.cli
import kiln.supervisor
from kiln.cli import main as kiln_main
from kiln.gateway.cli import main as gateway_main
from kiln.gateway.settings import Settings
from kiln.protocol.settings_fields import env_names, from_options
from kiln.settings import DECIDED_FLAGS, ServeSettings
from kiln.worker.cli import main as worker_main
from kiln.worker.settings import WorkerSettings

SETTING_VARS = env_names([ServeSettings, Settings, WorkerSettings])


class Recorded:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def run(self) -> int:
        return 0


_RUNTIME_DIRS: list[str] = []


@pytest.fixture(autouse=True)
def _runtime_dirs():
    """kiln serve removes its runtime folder (socket, generated models.toml) when it returns; here
    it stays until the test has parsed the children's command lines, which name the file."""
    yield
    while _RUNTIME_DIRS:
        shutil.rmtree(_RUNTIME_DIRS.pop(), ignore_errors=True)


def serve(monkeypatch, args: list[str], env: dict[str, str] | None = None) -> tuple[Any, str]:
    calls: list[Recorded] = []
    monkeypatch.setattr(kiln.supervisor, "build", lambda **kw: calls.append(Recorded(**kw)) or calls[-1])
    monkeypatch.setattr(kiln.cli, "shutil", SimpleNamespace(rmtree=lambda path, **kw: _RUNTIME_DIRS.append(path)))
    result = CliRunner().invoke(kiln_main, ["serve", *args], env={**{k: None for k in SETTING_VARS}, **(env or {})})
    return (calls[0] if calls else None), result.output + (str(result.exception) if result.exit_code not in (0, 2) else "")


def child_settings(monkeypatch, command, cls, argv: list[str], env: dict[str, str]) -> Any:
    """What the daemon's own command makes of this argv and environment."""
    with monkeypatch.context() as m:
        for name in SETTING_VARS:
            m.delenv(name, raising=False)
        for name, value in env.items():
            m.setenv(name, value)
        ctx = command.make_context(command.name or "daemon", list(argv))
    return from_options(cls, ctx.params)


def test_every_daemon_flag_is_a_serve_flag():
    serve_flags = {opt for p in kiln_main.commands["serve"].params for opt in p.opts}
    for command in (gateway_main, worker_main):
        flags = {opt for p in command.params for opt in p.opts if opt not in ("-h", "--help")}
        assert flags - serve_flags <= set(DECIDED_FLAGS)


def test_flags_and_variables_reach_the_right_child(monkeypatch, tmp_path):
    db = f"sqlite:///{tmp_path}/accounts.db"
    token = tmp_path / "admin"
    token.write_text("admin-secret\n")
    call, output = serve(monkeypatch, [
        "--port", "18123", "--store", "none", "--engine", "scripted", "--model-alias", "a", "--model-alias", "b c",
        "--auth", "keys", "--database-url", db, "--log-level", "INFO", "--workers", "2",
    ], env={"KILN_MAX_BATCH": "3", "LLAMA_ARG_RESPONSES_STORE_TTL_SECS": "5", "KILN_ADMIN_TOKEN_FILE": str(token), "KILN_REQUEST_LOG": "/dev/null"})
    assert call is not None, output
    gateway = child_settings(monkeypatch, gateway_main, Settings, call.gateway_args, call.gateway_env)
    assert (gateway.port, gateway.store_mode, gateway.auth, gateway.database_url, gateway.log_level) == (18123, "none", "keys", db, "info")
    assert gateway.responses_store_ttl_secs == 5 and gateway.admin_token == "admin-secret" and gateway.admin_token_file is None
    assert gateway.workers_bind.startswith("ipc://")
    # Secrets never on a command line; the token file was read once, the gateway gets the token.
    assert db not in " ".join(call.gateway_args) and "KILN_ADMIN_TOKEN_FILE" not in call.gateway_env
    assert call.gateway_env["KILN_REQUEST_LOG"] == "/dev/null"  # not a setting: inherited as it is
    assert [name for name, _ in call.workers] == ["worker-0", "worker-1"]
    for _, argv in call.workers:
        worker = child_settings(monkeypatch, worker_main, WorkerSettings, argv, call.worker_env)
        assert (worker.max_batch, worker.model_alias, worker.engine, worker.log_level) == (3, ("a", "b c"), "scripted", "info")
        assert worker.gateway == (gateway.workers_bind,) and worker.worker_secret == gateway.worker_secret is not None
    assert "KILN_DATABASE_URL" not in call.worker_env and "KILN_ADMIN_TOKEN" not in call.worker_env
    assert call.health_url == "http://127.0.0.1:18123/health"


def test_each_configured_model_gets_its_own_worker_settings(monkeypatch, tmp_path):
    path = tmp_path / "kiln.toml"
    path.write_text('[[models]]\nid = "m/a"\nsource = "x"\nworkers = 2\nmax_batch = 2\n\n[[models]]\nid = "b"\nsource = "y"\naliases = ["bee"]\ncontext_length = 512\n')
    call, output = serve(monkeypatch, ["--config", str(path), "--max-batch", "6", "--workers-bind", "tcp://127.0.0.1:18124"])
    assert call is not None, output
    got = {name: child_settings(monkeypatch, worker_main, WorkerSettings, argv, call.worker_env) for name, argv in call.workers}
    assert sorted(got) == ["worker-b-0", "worker-m_a-0", "worker-m_a-1"]
    a, b = got["worker-m_a-0"], got["worker-b-0"]
    assert (a.model, a.model_id, a.max_batch, a.gateway) == ("x", "m/a", 2, ("tcp://127.0.0.1:18124",))
    assert (b.model, b.model_id, b.model_alias, b.context_length, b.max_batch) == ("y", "b", ("bee",), 512, 6)


@pytest.mark.parametrize("args, names", [
    (["--responses-background-ephemeral-ttl-secs", "0"], "--responses-background-ephemeral-ttl-secs"),
    (["--auth", "keys"], "--database-url"),
    (["--max-batch", "0"], "--max-batch"),
    (["--weights", "int3"], "--weights"),
])
def test_bad_settings_stop_serve_before_anything_starts(monkeypatch, args, names):
    call, output = serve(monkeypatch, args)
    assert call is None and names in output


def test_config_models_reach_their_workers_and_the_gateway_reads_the_file(monkeypatch, tmp_path):
    config = tmp_path / "kiln.toml"
    config.write_text('[[models]]\nid = "a"\nsource = "x.gguf"\nmax_batch = 3\n'
                      '[[models]]\nid = "b"\nsource = "y.gguf"\naliases = ["bee"]\nload = "on-demand"\nworkers = 2\n')  # fmt: skip
    call, output = serve(monkeypatch, ["--config", str(config), "--max-batch", "5"])
    assert call is not None, output
    gateway = child_settings(monkeypatch, gateway_main, Settings, call.gateway_args, call.gateway_env)
    assert gateway.config_path == str(config) and gateway.supervisor_fd is None  # the supervisor adds it per start
    assert [name for name, _ in call.workers] == ["worker-a-0"]
    assert list(call.on_demand) == ["b"] and [name for name, _ in call.on_demand["b"]] == ["worker-b-0", "worker-b-1"]
    a = child_settings(monkeypatch, worker_main, WorkerSettings, call.workers[0][1], call.worker_env)
    b = child_settings(monkeypatch, worker_main, WorkerSettings, call.on_demand["b"][0][1], call.worker_env)
    assert (a.model_id, a.model, a.max_batch, a.config_path) == ("a", "x.gguf", 3, None)
    assert (b.model_id, b.model, b.model_alias, b.max_batch) == ("b", "y.gguf", ("bee",), 5)
