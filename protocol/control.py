"""The control channel between ``kiln serve``'s supervisor and its gateway.

The gateway decides when an on-demand model is needed and when it has been idle long enough
(it sees every request); the supervisor owns the processes. So the gateway asks, and the
supervisor does and reports:

    gateway -> supervisor   StartModel, StopModel
    supervisor -> gateway   ModelExited, ModelStopped

The channel is a Unix socket pair the supervisor makes for each gateway it starts (the gateway
gets its end as ``--supervisor-fd``): private to the two processes, so it needs no address or
secret. Each message is one line of JSON, an object whose ``"t"`` names the message, at most
``MAX_LINE`` bytes; unknown fields are dropped and unknown messages refused, as on the worker
protocol.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

MAX_LINE = 4096


@dataclass(frozen=True)
class StartModel:
    """Start the workers of ``model`` (a config id) unless they run; restart them if they die."""

    model: str


@dataclass(frozen=True)
class StopModel:
    """Stop the workers of ``model`` and leave them stopped; answered with ``ModelStopped``."""

    model: str


@dataclass(frozen=True)
class ModelExited:
    """A worker of an on-demand ``model`` exited while it was wanted (``code``: its status,
    negative for a signal); the supervisor restarts it unless told to stop."""

    model: str
    code: int


@dataclass(frozen=True)
class ModelStopped:
    """Every worker of ``model`` has exited after a ``StopModel``: its memory is back."""

    model: str


ControlMessage = StartModel | StopModel | ModelExited | ModelStopped
_TYPES: dict[str, type] = {cls.__name__: cls for cls in (StartModel, StopModel, ModelExited, ModelStopped)}


class ControlError(ValueError):
    """A line that is not a control message."""


def encode_line(message: ControlMessage) -> bytes:
    payload = {"t": type(message).__name__, **dataclasses.asdict(message)}
    line = json.dumps(payload, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_LINE:
        raise ControlError(f"control message of {len(line)} bytes is over {MAX_LINE}")
    return line


def decode_line(line: bytes) -> ControlMessage:
    if len(line) > MAX_LINE:
        raise ControlError("control line too long")
    try:
        payload = json.loads(line)
    except ValueError as exc:
        raise ControlError(f"not JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise ControlError("not an object")
    cls = _TYPES.get(payload.pop("t", None))
    if cls is None:
        raise ControlError("unknown control message")
    names = {f.name: f.type for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {k: v for k, v in payload.items() if k in names}
    for key, value in values.items():
        expected = int if key == "code" else str
        if not isinstance(value, expected) or isinstance(value, bool):
            raise ControlError(f"bad {cls.__name__}.{key}")
    try:
        message: ControlMessage = cls(**values)
    except TypeError as exc:
        raise ControlError(f"bad {cls.__name__}: {exc}") from exc
    return message
