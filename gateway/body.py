"""Reading request bodies with a size bound."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from .errors import ApiError, invalid


async def read_json(request: Request, max_bytes: int) -> Any:
    """The parsed JSON body; 413 past ``max_bytes`` (checked while reading, not after)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise invalid("The request body is empty; expected a JSON object.")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}.")


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"The request body is larger than the limit of {max_bytes} bytes.", code="request_too_large")
