"""msgpack encoding of protocol messages."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import msgpack

from .messages import MESSAGE_TYPES
from .request import GenerateRequest, InvalidParam
from .usage import InvalidUsage, Usage

# Fields that hold a typed value rather than plain msgpack values: encoded with ``to_wire()``,
# decoded with ``from_wire()`` (which checks every range again).
TYPED_FIELDS: dict[str, Any] = {"request": GenerateRequest, "usage": Usage}


class ProtocolError(ValueError):
    """A frame that is not a message this version knows."""


class InvalidRequest(ProtocolError):
    """A well-formed request frame whose request has a value out of range: answered with a 400
    naming ``param`` for ``req_id``, not dropped (the gateway is waiting for an answer)."""

    def __init__(self, req_id: str, param: str, message: str) -> None:
        super().__init__(message)
        self.req_id = req_id
        self.param = param
        self.message = message


class BadReport(ProtocolError):
    """A well-formed frame from a worker whose usage no request can have (``reason`` says why):
    not a frame to drop quietly but a worker to stop trusting (gateway/pool/workers.py)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"bad {kind}: {reason}")
        self.kind = kind
        self.reason = reason


@functools.cache
def _field_names(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@functools.cache
def _optional(cls: Any) -> frozenset[str]:
    """The fields of ``cls`` that may be absent (None by default, as ``Event.usage``)."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.default is None)


def encode(message: Any) -> bytes:
    # A shallow map: fields are plain msgpack-able values, except the typed ones, which say
    # their own wire form (dataclasses.asdict would deep-copy every request on the way out).
    cls = type(message)
    payload = {}
    for name in _field_names(cls):  # type: ignore[arg-type]
        value = getattr(message, name)
        payload[name] = value.to_wire() if name in TYPED_FIELDS and value is not None else value
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
    fields = {k: v for k, v in payload.items() if k in names}
    for name, typed in TYPED_FIELDS.items():
        if name in fields and not (fields[name] is None and name in _optional(cls)):
            try:
                fields[name] = typed.from_wire(fields[name])
            except InvalidParam as exc:
                req_id = fields.get("req_id")
                if not isinstance(req_id, str):
                    raise ProtocolError(f"bad {cls.__name__}: {exc}") from exc
                raise InvalidRequest(req_id, exc.param, exc.message) from exc
            except InvalidUsage as exc:
                raise BadReport(cls.__name__, str(exc)) from exc
            except (TypeError, AttributeError) as exc:  # a shape no constructor takes
                raise ProtocolError(f"bad {cls.__name__}.{name}: {exc}") from exc
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ProtocolError(f"bad {cls.__name__}: {exc}") from exc
