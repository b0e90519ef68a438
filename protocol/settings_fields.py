"""Typed settings dataclasses as command-line options, and back.

Each daemon's settings are one dataclass (``gateway/settings.py``, ``worker/settings.py``). A field a
user may set is declared with :func:`setting`: its help, its bounds and, where they differ from the
field's name, its flag and the spec's environment names. Its type says the rest:

- ``Literal["a", "b"]`` is a choice, ``bool`` a switch, ``int``/``float`` a number (``min``/``max``);
- ``X | None`` may be left unset; ``tuple[str, ...]`` is a repeatable flag, or one comma list when
  the field gives a ``separator``, or both (``repeatable=True`` too: each value may be a list);
- every flag reads ``KILN_<FLAG>`` and then the spec's names (``LLAMA_ARG_…``, ``MLXCEL_…``).

From that one declaration this module builds the click options (:func:`settings_options`), turns
what click parsed into a typed instance (:func:`from_options`), and turns an instance back into a
child process's argv (:func:`to_argv`) and environment (:func:`child_env`), so that ``kiln serve``
forwards settings to its daemons without naming any of them. Adding a flag is adding one field.

Bad values are refused by click while it parses (the message names the flag and, when it came from
there, the variable). Checks that involve several fields are explicit functions next to each daemon's
CLI, not metadata.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

import click

_KEY = "kiln.setting"
_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Setting:
    """How a user sets one field: what :func:`setting` stored in the field's metadata."""

    help: str
    flag: str | None = None  # default: the field's name, "--max-batch" for max_batch
    spec_env: tuple[str, ...] = ()  # the spec's names for the same setting, read after KILN_…
    min: float | None = None
    max: float | None = None
    min_open: bool = False  # min itself is refused (a timeout that must be positive)
    separator: str | None = None  # a tuple field given as one list ("a,b"), not a repeated flag
    repeatable: bool = False  # with a separator: the flag may also be repeated, each value a list
    file: bool = False  # a file path; must_exist: refused by click when it is not there
    must_exist: bool = False
    secret: bool = False  # handed to child processes in their environment, never their argv
    show_default: bool = True


def setting(
    default: Any,
    *,
    help: str,
    flag: str | None = None,
    spec_env: str | Sequence[str] = (),
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    separator: str | None = None,
    repeatable: bool = False,
    file: bool = False,
    must_exist: bool = False,
    secret: bool = False,
    show_default: bool = True,
) -> Any:
    """A dataclass field that users can set by flag and environment variable."""
    names = (spec_env,) if isinstance(spec_env, str) else tuple(spec_env)
    spec = Setting(help, flag, names, min, max, min_open, separator, repeatable, file, must_exist, secret, show_default)
    return dataclasses.field(default=default, metadata={_KEY: spec})


@dataclasses.dataclass(frozen=True)
class SettingField:
    """One settable field of a settings class, resolved: its flag, its variables, its shape."""

    name: str
    flag: str
    env: tuple[str, ...]  # KILN_… first
    base: type  # str, int, float or bool
    choices: tuple[str, ...] | None
    optional: bool
    many: bool  # a tuple of values
    default: Any
    spec: Setting

    @property
    def repeatable(self) -> bool:
        return self.many and (self.spec.separator is None or self.spec.repeatable)

    @property
    def one_list(self) -> bool:
        """A tuple given as one separated list only (not a repeated flag)."""
        return self.many and self.spec.separator is not None and not self.spec.repeatable


def kiln_env(flag: str) -> str:
    """``--max-batch`` → ``KILN_MAX_BATCH``."""
    return "KILN_" + flag.lstrip("-").upper().replace("-", "_")


def _shape(hint: Any, where: str) -> tuple[type, tuple[str, ...] | None, bool, bool]:
    """(base type, choices, optional, many) of a field's annotation; anything else is a bug."""
    optional = False
    if typing.get_origin(hint) in (Union, types.UnionType):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{where}: only `X | None` unions are settings")
        optional, hint = True, rest[0]
    many = False
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{where}: a repeatable setting is tuple[X, ...]")
        many, hint = True, args[0]
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if not all(isinstance(c, str) for c in choices):
            raise TypeError(f"{where}: choices are strings")
        return str, choices, optional, many
    if hint in (str, int, float, bool):
        return hint, None, optional, many
    raise TypeError(f"{where}: unsupported setting type {hint!r}")


def setting_fields(cls: type) -> list[SettingField]:
    """The settable fields of a settings dataclass, in declaration order."""
    return list(_resolved_fields(cls))


@functools.cache
def _resolved_fields(cls: type) -> tuple[SettingField, ...]:
    """Resolved once per class: a class's fields never change, and resolving them (type hints
    included) for every env name and argv a start computes cost ~0.2 s of ``kiln serve``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is None:
            continue  # a tunable for code and tests, not a flag
        where = f"{cls.__name__}.{f.name}"
        base, choices, optional, many = _shape(hints[f.name], where)
        flag = spec.flag or "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if base is bool and (many or optional):
            raise TypeError(f"{where}: a switch is a plain bool")
        out.append(SettingField(f.name, flag, (kiln_env(flag), *spec.spec_env), base, choices, optional, many, default, spec))
    return tuple(out)


def _click_type(sf: SettingField) -> click.ParamType[Any] | None:
    spec = sf.spec
    if sf.choices is not None:
        return click.Choice(sf.choices, case_sensitive=False)
    if sf.base is int:
        if spec.min is None and spec.max is None:
            return click.INT
        return click.IntRange(_int_or_none(spec.min), _int_or_none(spec.max), min_open=spec.min_open)
    if sf.base is float:
        if spec.min is None and spec.max is None:
            return click.FLOAT
        return click.FloatRange(spec.min, spec.max, min_open=spec.min_open)
    if spec.file:
        return click.Path(exists=spec.must_exist, dir_okay=False)
    return None if sf.base is bool else click.STRING


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def click_option(sf: SettingField) -> click.Option:
    """The click option of one field; its parameter name is the field's name."""
    spec = sf.spec
    kwargs: dict[str, Any] = {
        "envvar": list(sf.env),
        "show_envvar": True,
        "help": spec.help,
        "show_default": spec.show_default and sf.default not in (None, (), False) and not spec.secret,
    }
    if sf.base is bool:
        decls = [f"{sf.flag}/--no-{sf.flag[2:]}" if sf.default else sf.flag, sf.name]
        return click.Option(decls, is_flag=True, default=bool(sf.default), **kwargs)
    if sf.repeatable and sf.spec.separator is not None:
        # Split while click parses, so what it hands on (to us or to anyone reading ctx.params)
        # is already one value per item: `--gateway a,b --gateway c` and `KILN_GATEWAY=a,b` alike.
        kwargs["callback"] = lambda _ctx, _param, value: _split_all(value, str(sf.spec.separator))
    return click.Option([sf.flag, sf.name], type=_click_type(sf), default=sf.default, multiple=sf.repeatable, **kwargs)


def _split_all(values: Iterable[str] | None, separator: str) -> tuple[str, ...]:
    return tuple(part.strip() for value in values or () for part in str(value).split(separator) if part.strip())


def settings_options(*classes: type, exclude: Collection[str] = ()) -> Callable[[_F], _F]:
    """A decorator adding the options of these settings classes to a click command.

    A flag declared by several classes (``--log-level`` on both daemons) is added once, as the first
    class declares it; the others read the same parameter. Flags in `exclude` are left out (the
    command decides them itself).
    """
    seen: set[str] = set(exclude)
    options = []
    for cls in classes:
        for sf in setting_fields(cls):
            if sf.flag not in seen:
                seen.add(sf.flag)
                options.append(click_option(sf))

    def decorate(func: _F) -> _F:
        params: list[click.Parameter] = list(getattr(func, "__click_params__", []))
        # click applies decorators bottom-up and reverses the list, so add ours reversed.
        params.extend(reversed(options))
        setattr(func, "__click_params__", params)  # noqa: B010 (an attribute mypy cannot see on a Callable)
        return func

    return decorate


def _value(sf: SettingField, value: Any) -> Any:
    """A parsed option value as the field holds it."""
    if sf.one_list:
        if value is None:
            return sf.default
        items = tuple(part.strip() for part in str(value).split(sf.spec.separator) if part.strip())
        return items or (None if sf.optional else ())
    if sf.many:
        return tuple(value)
    return value


def from_options(cls: type[_T], options: Mapping[str, Any]) -> _T:
    """An instance of `cls` from click's parsed options (keys: field names; others ignored)."""
    values = {sf.name: _value(sf, options[sf.name]) for sf in setting_fields(cls) if sf.name in options}
    return cls(**values)


def _format(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def argv_of(cls: type, values: Mapping[str, Any]) -> list[str]:
    """Command-line arguments that set these fields of `cls` to these values (secrets refused)."""
    fields = {sf.name: sf for sf in setting_fields(cls)}
    argv: list[str] = []
    for name, value in values.items():
        sf = fields[name]
        if sf.spec.secret:
            raise ValueError(f"{sf.flag} is a secret: it goes to a child's environment, not its argv")
        if sf.base is bool:
            argv.append(sf.flag if value else f"--no-{sf.flag[2:]}")
        elif value is None:
            raise ValueError(f"{sf.flag} cannot be unset on a command line")
        elif sf.repeatable:
            for item in value:
                argv += [sf.flag, _format(item)]
        elif sf.one_list:
            argv += [sf.flag, str(sf.spec.separator).join(value)]
        else:
            argv += [sf.flag, _format(value)]
    return argv


def to_argv(settings: Any) -> list[str]:
    """The argv that gives a child process these settings: every non-secret field that differs from
    its default (secrets travel in :func:`child_env`)."""
    changed = {
        sf.name: getattr(settings, sf.name)
        for sf in setting_fields(type(settings))
        if not sf.spec.secret and getattr(settings, sf.name) != sf.default
    }
    return argv_of(type(settings), changed)


def env_names(classes: Iterable[type]) -> set[str]:
    """Every environment variable the settings of these classes are read from."""
    return {name for cls in classes for sf in setting_fields(cls) for name in sf.env}


def child_env(settings: Any, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a child process given `settings` with :func:`to_argv`.

    The variables of every setting are removed (what the parent read from them is in the argv now,
    or is the default), and the secrets are set under their ``KILN_…`` name, so the child's
    settings are exactly these whatever the parent's environment held.
    """
    fields = setting_fields(type(settings))
    env = {k: v for k, v in environ.items() if k not in env_names([type(settings)])}
    for sf in fields:
        value = getattr(settings, sf.name)
        if sf.spec.secret and value is not None:
            env[sf.env[0]] = str(value)
    return env
