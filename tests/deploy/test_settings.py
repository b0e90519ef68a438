"""Every flag and KILN_ variable the deploy/ files give a daemon exists in that daemon's CLI and
takes the value given, so the deploy files cannot drift from the code.

Each setting is parsed by the daemon's own click command (``make_context``: parsing and its
checks, nothing run), alone, so a failure names the file and the setting. A path names a file of
the target host; here a temporary file stands in for it. Besides being accepted, a setting given
N times, or a value listing N ``tcp://`` addresses, must reach the daemon as N values: click
would otherwise keep one silently.

PENDING lists what deploy/ already uses and other branches are adding (issue 18). When one lands,
its test here fails saying so: remove it from PENDING then.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import click
import pytest
from dockerfile_parse import DockerfileParser

from kiln.gateway.cli import main as gateway_cli
from kiln.worker.cli import main as worker_cli
from tests.deploy.files import COMPOSE, DEPLOY, DOCKERFILE, ENTRYPOINT, UNITS, compose, manifests, role
from tests.support import REPO

COMMANDS: dict[str, click.Command] = {"gateway": gateway_cli, "worker": worker_cli}
SOURCES = {"gateway": ["gateway", "protocol"], "worker": ["worker", "protocol"]}

# (daemon, setting as the problem names it) -> what is being built, where. Trim as they merge.
PENDING: dict[tuple[str, str], str] = {
}


@dataclass(frozen=True)
class Process:
    """One daemon as a deploy file starts it: where, which daemon, its arguments and environment."""

    where: str
    daemon: str  # "gateway", "worker", or "any" (the image's environment, seen by both)
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    image: bool  # started through the image's entrypoint (deploy/docker/entrypoint.sh)


def _env_lines(text: str) -> list[tuple[str, str]]:
    return [tuple(line.split("=", 1)) for line in text.splitlines() if re.match(r"^KILN_\w+=", line)]


def processes() -> list[Process]:
    out = []
    for name, service in compose()["services"].items():
        if daemon := role(service.get("command")):
            env = tuple((k, str(v)) for k, v in (service.get("environment") or {}).items())
            out.append(Process(f"{COMPOSE.name}:{name}", daemon, tuple(service["command"][1:]), env, True))
    config_maps = {d["metadata"]["name"]: d["data"] for _, d in manifests() if d["kind"] == "ConfigMap"}
    for path, doc in manifests():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            env = [(k, str(v)) for ref in container.get("envFrom", []) for k, v in config_maps[ref["configMapRef"]["name"]].items()]
            env += [(e["name"], str(e["value"])) for e in container.get("env", []) if "value" in e]
            out.append(Process(f"k8s/{path.name}:{doc['metadata']['name']}", role(container["args"]), tuple(container["args"][1:]), tuple(env), True))
    for unit in UNITS:
        text = unit.read_text()
        daemon = "gateway" if unit.name.startswith("kiln-gateway") else "worker"
        [exec_start] = re.findall(r"^ExecStart=(.*)$", text, re.M)
        env = [tuple(v.split("=", 1)) for v in re.findall(r"^Environment=(KILN_.*)$", text, re.M)]
        env_file = DEPLOY / "systemd" / f"{daemon}.env.example"
        out.append(Process(f"systemd/{unit.name} + {env_file.name}", daemon, tuple(exec_start.split()[1:]), tuple(env + _env_lines(env_file.read_text())), False))
    image_env = tuple((k, v) for k, v in DockerfileParser(str(DOCKERFILE)).envs.items() if k.startswith("KILN_"))
    out.append(Process(DOCKERFILE.name + ": ENV", "any", (), image_env, True))
    return out


def entrypoint_files() -> set[str]:
    """The KILN_<NAME>_FILE variables the image's entrypoint reads into KILN_<NAME>."""
    [names] = re.findall(r"^for name in (.*); do$", ENTRYPOINT.read_text(), re.M)
    return {f"{name}_FILE" for name in names.split()}


@cache
def environment_only(daemon: str) -> frozenset[str]:
    """KILN_ variables a daemon reads without a flag (KILN_NATIVE_CACHE, ...): quoted in its source."""
    names: set[str] = set()
    for folder in SOURCES[daemon]:
        for path in (REPO / folder).rglob("*.py"):
            names |= set(re.findall(r"""["'](KILN_[A-Z0-9_]+)["']""", path.read_text()))
    return frozenset(names)


def _params(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option)]


def _by_flag(command: click.Command, flag: str) -> click.Option | None:
    return next((p for p in _params(command) if flag in p.opts or flag in p.secondary_opts), None)


def _by_env(command: click.Command, name: str) -> click.Option | None:
    return next((p for p in _params(command) if name in ([p.envvar] if isinstance(p.envvar, str) else list(p.envvar or []))), None)


def _count(value) -> int:
    return len(value) if isinstance(value, (list, tuple)) else 0 if value is None else 1


def _parse(command: click.Command, param: click.Option, args: list[str], env: dict[str, str], stand_in: str) -> tuple[object, str | None]:
    """The value click gives `param` from these args and environment (alone), or its error."""
    if isinstance(param.type, click.Path):  # a path on the target host: a local file stands in
        args = [stand_in if i and args[i - 1] in param.opts else a for i, a in enumerate(args)]
        env = {k: stand_in for k in env}
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({"PATH": saved.get("PATH", "/usr/bin:/bin"), **env})
    try:
        ctx = command.make_context(command.name or "kiln", list(args))
        return ctx.params.get(param.name), None
    except click.ClickException as exc:
        return None, exc.format_message()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _split_flags(command: click.Command, args: tuple[str, ...]) -> tuple[dict[str, list[str]], list[str]]:
    """The args grouped per flag as given ({flag: [its tokens]}), and unknown flags."""
    grouped: dict[str, list[str]] = {}
    unknown = []
    i = 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        param = _by_flag(command, flag)
        if param is None:  # an unknown flag (its value, if any, is skipped as a stray word)
            if args[i].startswith("-"):
                unknown.append(flag)
            i += 1
            continue
        takes_value = not param.is_flag and "=" not in args[i]
        grouped.setdefault(param.opts[0], []).extend(args[i : i + 1 + takes_value])
        i += 1 + takes_value
    return grouped, unknown


def problems(stand_in: str) -> list[tuple[str, str, str, str]]:
    """(daemon, setting, where, what is wrong) for every setting deploy/ gives a daemon."""
    out = []
    for proc in processes():
        daemons = ["gateway", "worker"] if proc.daemon == "any" else [proc.daemon]
        for name, value in proc.env:
            if proc.image and name in entrypoint_files():
                continue
            owners = [d for d in daemons if _by_env(COMMANDS[d], name) or name in environment_only(d)]
            if not owners:
                out.append((proc.daemon, name, proc.where, f"no {' or '.join(daemons)} setting reads {name}"))
                continue
            for daemon in owners:
                param = _by_env(COMMANDS[daemon], name)
                if param is None:
                    continue
                parsed, error = _parse(COMMANDS[daemon], param, [], {name: value}, stand_in)
                addresses = value.count("tcp://")
                if error:
                    out.append((daemon, name, proc.where, error))
                elif addresses > 1 and _count(parsed) != addresses:
                    out.append((daemon, name, proc.where, f"{addresses} addresses given, {_count(parsed)} reach the {daemon}"))
        if proc.daemon == "any":
            continue
        command = COMMANDS[proc.daemon]
        grouped, unknown = _split_flags(command, proc.args)
        out += [(proc.daemon, flag, proc.where, f"kiln-{proc.daemon} has no option {flag}") for flag in unknown]
        for flag, tokens in grouped.items():
            param = _by_flag(command, flag)
            parsed, error = _parse(command, param, tokens, {}, stand_in)
            given = sum(1 for t in tokens if t.split("=", 1)[0] in param.opts)
            if error:
                out.append((proc.daemon, flag, proc.where, error))
            elif given > 1 and _count(parsed) != given:
                out.append((proc.daemon, flag, proc.where, f"given {given} times, {_count(parsed)} value(s) reach the {proc.daemon}"))
    return out


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> list[tuple[str, str, str, str]]:
    stand_in = tmp_path_factory.mktemp("host") / "file"
    stand_in.write_text("stand-in\n")
    return problems(str(stand_in))


def test_deploy_files_start_the_daemons_we_expect():
    kinds = {(p.where.split(":")[0].split(" ")[0], p.daemon) for p in processes()}
    assert {("compose.yaml", "gateway"), ("compose.yaml", "worker"), ("k8s/gateway.yaml", "gateway"), ("k8s/worker.yaml", "worker"),
            ("systemd/kiln-gateway.service", "gateway"), ("systemd/kiln-worker@.service", "worker"), ("Dockerfile", "any")} <= kinds  # fmt: skip


def test_every_setting_exists_and_takes_its_value(found):
    unexpected = [f"{where}: {setting} ({daemon}): {what}" for daemon, setting, where, what in found if (daemon, setting) not in PENDING]
    assert unexpected == []


@pytest.mark.parametrize("key", sorted(PENDING), ids=lambda k: f"{k[0]}:{k[1]}")
def test_pending_settings_are_still_pending(found, key):
    assert key in {(daemon, setting) for daemon, setting, *_ in found}, f"{key[1]} works now ({PENDING[key]}): remove it from PENDING in {Path(__file__).name}"


def test_every_kiln_variable_named_anywhere_in_deploy_exists():
    """Comments and docs in deploy/ included: a renamed variable leaves no stale mention."""
    known = entrypoint_files() | {name for d, c in COMMANDS.items() for p in _params(c) for name in ([p.envvar] if isinstance(p.envvar, str) else list(p.envvar or []))}
    known |= environment_only("gateway") | environment_only("worker")
    named = {(path.relative_to(DEPLOY), name) for path in DEPLOY.rglob("*") if path.is_file() for name in re.findall(r"\bKILN_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    assert sorted((str(p), n) for p, n in named if n not in known) == []


def test_the_checks_catch_a_misspelt_flag_and_a_bad_value(tmp_path):
    """The checks themselves: a flag that does not exist and a value out of its choices are found."""
    stand_in = tmp_path / "f"
    stand_in.write_text("x")
    _, unknown = _split_flags(worker_cli, ("--max-bach", "8"))
    assert unknown == ["--max-bach"]
    _, error = _parse(gateway_cli, _by_env(gateway_cli, "KILN_AUTH"), [], {"KILN_AUTH": "tokens"}, str(stand_in))
    assert error and "tokens" in error
    value, error = _parse(worker_cli, _by_flag(worker_cli, "--max-batch"), ["--max-batch", "8"], {}, str(stand_in))
    assert (value, error) == (8, None)
