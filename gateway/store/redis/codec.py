"""How values are written to Redis: compact JSON, UTF-8."""

from __future__ import annotations

import json
from typing import Any


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def loads(raw: bytes | str | None) -> Any:
    return None if raw is None else json.loads(raw)
