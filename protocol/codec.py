"""msgpack encoding of protocol messages."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import msgpack

from .messages import MESSAGE_TYPES


class ProtocolError(ValueError):
    """A frame that is not a message this version knows."""


@functools.cache
def _field_names(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def encode(message: Any) -> bytes:
    # Fields are plain msgpack-able values (no nested dataclasses), so a shallow map is
    # enough; dataclasses.asdict would deep-copy every request body on the way out.
    cls = type(message)
    payload = {name: getattr(message, name) for name in _field_names(cls)}  # type: ignore[arg-type]
    payload["t"] = cls.__name__
    packed: bytes = msgpack.packb(payload, use_bin_type=True)
    return packed


def decode(frame: bytes) -> Any:
    try:
        payload = msgpack.unpackb(frame, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {exc}") from exc
    if not isinstance(payload, dict):
        raise ProtocolError("frame is not a map")
    cls = MESSAGE_TYPES.get(payload.pop("t", None))
    if cls is None:
        raise ProtocolError("unknown message type")
    # Fields a newer peer added are dropped, so additions stay compatible within a version.
    names = _field_names(cls)
    try:
        return cls(**{k: v for k, v in payload.items() if k in names})
    except TypeError as exc:
        raise ProtocolError(f"bad {cls.__name__}: {exc}") from exc
