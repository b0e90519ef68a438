"""protocol/settings_fields.py: a settings dataclass becomes click options and comes back typed, and
an instance becomes the argv and environment that give a child process the same settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import click
import pytest
from click.testing import CliRunner

from kiln.protocol.settings_fields import child_env, env_names, from_options, setting, setting_fields, settings_options, to_argv


@dataclass(frozen=True)
class Demo:
    name: str = setting("kiln", help="A name.")
    count: int = setting(4, min=1, max=10, help="A bounded count.")
    timeout_s: float = setting(2.5, flag="--timeout", min=0, min_open=True, help="A positive timeout.")
    mode: Literal["fast", "slow"] = setting("fast", help="A choice.")
    loud: bool = setting(False, help="A switch.")
    tag: tuple[str, ...] = setting((), help="Repeatable.")
    hosts: tuple[str, ...] | None = setting(None, separator=",", help="A comma list.")
    peers: tuple[str, ...] = setting((), separator=",", repeatable=True, help="Repeatable, each a comma list.")
    limit: int | None = setting(None, help="Optional.")
    ttl: int = setting(60, spec_env="LLAMA_ARG_TTL", help="Has a spec name.")
    token: str | None = setting(None, secret=True, help="A secret.")
    internal: int = 7  # no setting: not a flag


@dataclass(frozen=True)
class Other:
    loud: bool = setting(False, help="Shared with Demo.")
    extra: str = setting("x", help="Only here.")


def _command(*classes: type, exclude: tuple[str, ...] = ()) -> tuple[click.Command, list[Any]]:
    seen: list[Any] = []

    @click.command()
    @settings_options(*classes, exclude=exclude)
    def cmd(**options: Any) -> None:
        seen.append(options)

    return cmd, seen


def _env(cls: type, env: dict[str, str] | None) -> dict[str, str | None]:
    """Exactly `env` for the settings of `cls`: the ones of the machine running the tests unset."""
    return {**{name: None for name in env_names([cls])}, **(env or {})}


def parse(argv: list[str], env: dict[str, str] | None = None, cls: type = Demo) -> Any:
    cmd, seen = _command(cls)
    result = CliRunner().invoke(cmd, argv, env=_env(cls, env), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return from_options(cls, seen[0])


def refusal(argv: list[str], env: dict[str, str] | None = None) -> str:
    cmd, _ = _command(Demo)
    result = CliRunner().invoke(cmd, argv, env=_env(Demo, env))
    assert result.exit_code == 2, result.output
    return result.output


def test_defaults_come_from_the_dataclass():
    assert parse([]) == Demo()


def test_flags_give_a_typed_instance():
    got = parse(["--name", "n", "--count", "3", "--timeout", "0.5", "--mode", "slow", "--loud", "--tag", "a", "--tag", "b", "--hosts", " x, ,y ", "--limit", "9", "--token", "s"])
    assert got == Demo(name="n", count=3, timeout_s=0.5, mode="slow", loud=True, tag=("a", "b"), hosts=("x", "y"), limit=9, token="s")


def test_environment_names_kiln_first_then_the_spec_and_the_flag_wins():
    assert parse([], {"LLAMA_ARG_TTL": "5"}).ttl == 5
    assert parse([], {"LLAMA_ARG_TTL": "5", "KILN_TTL": "6"}).ttl == 6
    assert parse(["--ttl", "7"], {"KILN_TTL": "6"}).ttl == 7
    got = parse([], {"KILN_LOUD": "1", "KILN_TAG": "a b", "KILN_HOSTS": "h1,h2", "KILN_MODE": "SLOW", "KILN_TIMEOUT": "3"})
    assert (got.loud, got.tag, got.hosts, got.mode, got.timeout_s) == (True, ("a", "b"), ("h1", "h2"), "slow", 3.0)


@pytest.mark.parametrize("argv, env, names", [
    (["--mode", "medium"], {}, "'--mode'"),
    (["--count", "0"], {}, "'--count'"),
    (["--count", "11"], {}, "'--count'"),
    (["--count", "x"], {}, "'--count'"),
    (["--timeout", "0"], {}, "'--timeout'"),
    ([], {"KILN_COUNT": "99"}, "KILN_COUNT"),
])
def test_bad_values_are_usage_errors_naming_the_flag(argv, env, names):
    assert names in refusal(argv, env)


def test_argv_and_env_give_a_child_the_same_settings():
    settings = Demo(name="n", count=3, timeout_s=0.1, mode="slow", loud=True, tag=("a b", "c"), hosts=("x", "y"), limit=9, ttl=1, token="s3cret")
    argv = to_argv(settings)
    assert "s3cret" not in argv  # secrets never on a command line
    env = child_env(settings, {"KILN_TTL": "99", "LLAMA_ARG_TTL": "98", "KILN_TOKEN": "old", "PATH": "/bin"})
    assert env == {"PATH": "/bin", "KILN_TOKEN": "s3cret"}  # setting variables scrubbed, other ones kept
    assert parse(argv, env) == settings


def test_a_repeatable_list_splits_each_value_and_its_variable():
    assert parse(["--peers", "a,b", "--peers", " c "]).peers == ("a", "b", "c")
    assert parse([], {"KILN_PEERS": "a, b"}).peers == ("a", "b")
    assert parse(to_argv(Demo(peers=("a", "b")))) == Demo(peers=("a", "b"))


def test_only_changed_fields_are_forwarded():
    assert to_argv(Demo()) == []
    assert to_argv(Demo(count=5)) == ["--count", "5"]


def test_a_switch_with_a_true_default_can_be_turned_off():
    @dataclass
    class On:
        on: bool = setting(True, help="On unless told.")

    assert parse([], cls=On) == On(True)
    assert parse(["--no-on"], cls=On) == On(False)
    assert parse(to_argv(On(False)), cls=On) == On(False)


def test_several_classes_share_a_flag_and_exclude_others():
    cmd, _ = _command(Demo, Other, exclude=("--name",))
    flags = [opt for p in cmd.params for opt in p.opts]
    assert flags.count("--loud") == 1 and "--extra" in flags and "--name" not in flags
    assert [sf.name for sf in setting_fields(Demo)][-1] == "token"  # "internal" is no setting
    assert "KILN_EXTRA" in env_names([Demo, Other]) and "LLAMA_ARG_TTL" in env_names([Demo])


def test_unsupported_field_types_are_refused_when_read():
    @dataclass
    class Bad:
        ratio: complex = setting(1j, help="?")

    with pytest.raises(TypeError, match="Bad.ratio"):
        setting_fields(Bad)


def test_kilns_settings_classes_round_trip():
    from kiln.gateway.settings import Settings
    from kiln.settings import ServeSettings
    from kiln.worker.settings import WorkerSettings

    for cls in (Settings, WorkerSettings, ServeSettings):
        assert parse([], cls=cls) == cls()  # the dataclass is the only source of each default
    gateway = Settings(port=9, store_mode="none", allowed_hosts=("a", "b"), allow_public_no_auth=True, database_url="sqlite:///x", first_event_timeout_s=0.25)
    assert parse(to_argv(gateway), child_env(gateway, {}), cls=Settings) == gateway
    worker = WorkerSettings(model_alias=("x", "y"), max_batch=2, engine="scripted", scripted_delay=0.01, worker_secret="k" * 16)
    assert parse(to_argv(worker), child_env(worker, {}), cls=WorkerSettings) == worker
    assert dataclasses.replace(worker, worker_secret=None) == parse(to_argv(worker), cls=WorkerSettings)
