"""The gateway-worker protocol: the only code both daemons import."""

from .codec import BadReport, InvalidRequest, ProtocolError, decode, encode
from .messages import (
    PROTOCOL_VERSION,
    Cancel,
    Compact,
    Compacted,
    CountTokens,
    Done,
    Event,
    Failed,
    Generate,
    Heartbeat,
    Register,
    Registered,
    TokenCount,
)

HEARTBEAT_INTERVAL_S = 1.0
# Where a gateway binds its worker socket and a worker connects when neither is told otherwise
# (``kiln serve`` chooses a private one for its children instead).
DEFAULT_WORKERS_ADDRESS = "tcp://127.0.0.1:5555"

__all__ = [
    "PROTOCOL_VERSION",
    "HEARTBEAT_INTERVAL_S",
    "DEFAULT_WORKERS_ADDRESS",
    "ProtocolError",
    "BadReport",
    "InvalidRequest",
    "encode",
    "decode",
    "Register",
    "Registered",
    "Heartbeat",
    "Generate",
    "CountTokens",
    "Cancel",
    "Compact",
    "Compacted",
    "Event",
    "Done",
    "Failed",
    "TokenCount",
]
