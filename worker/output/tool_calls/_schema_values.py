"""Typing XML parameter values (Qwen3-Coder) by the tool's JSON schema.

XML-style formats write every value as bare text; the schema says whether
``5`` is the integer 5 or the string "5". Without a schema a value stays a
string (as mlx-lm and Qwen's reference parser do). A value that does not
convert to its declared type is kept as a string rather than dropped.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

_MISSING = object()


def schema_types(schema: dict[str, Any] | None) -> list[str] | None:
    """The declared JSON types of a property (None: no schema or no "type")."""
    if not isinstance(schema, dict) or "type" not in schema:
        return None
    declared = schema["type"]
    items = declared if isinstance(declared, list) else [declared]
    return [str(t).strip().lower() for t in items]


def streams_as_string(schema: dict[str, Any] | None) -> bool:
    """Whether the value is surely a JSON string, so it can stream as typed."""
    if schema is None:
        return True
    return schema_types(schema) == ["string"]


def convert_value(text: str, schema: dict[str, Any] | None) -> Any:
    """The JSON value for ``text`` given its property schema."""
    if schema is None:
        return text
    types = schema_types(schema)
    if types is None:
        # A schema without "type" (anyOf, enum, ...): take JSON containers.
        value = _json(text)
        return value if isinstance(value, (dict, list)) else text
    stripped = text.strip()
    if "null" in types and stripped.lower() in ("null", "none"):
        return None
    for kind in types:
        value = _convert(stripped, kind)
        if value is not _MISSING:
            return value
    return text


def _convert(text: str, kind: str) -> Any:
    if kind in ("string", "str", "text"):
        return _MISSING  # strings are the fallback, after the other types
    if kind in ("integer", "int"):
        try:
            return int(text)
        except ValueError:
            number = _number(text)
            if isinstance(number, float) and number.is_integer():
                return int(number)
            return _MISSING
    if kind in ("number", "float"):
        number = _number(text)
        return _MISSING if number is None else number
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(text.lower(), _MISSING)
    if kind in ("object", "array"):
        value = _json(text)
        if value is _MISSING:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return _MISSING
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                return _MISSING
        wanted = dict if kind == "object" else list
        return value if isinstance(value, wanted) else _MISSING
    return _MISSING


def _number(text: str) -> int | float | None:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return _MISSING
