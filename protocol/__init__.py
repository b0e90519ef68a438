"""The gateway-worker protocol: the only code both daemons import."""

from .codec import ProtocolError, decode, encode
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

__all__ = [
    "PROTOCOL_VERSION",
    "HEARTBEAT_INTERVAL_S",
    "ProtocolError",
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
