"""Reading and parsing request bodies: a size bound, then JSON that every later step can handle.

Python's ``json`` accepts more than the gateway, msgpack and the SDKs can carry, so the parse here
refuses it at the edge with a 400 ``invalid_request_error`` instead of letting it reach a worker
(where msgpack fails after the request was registered) or a serializer (which writes ``NaN``):

- ``NaN``, ``Infinity``, ``-Infinity`` and numbers that overflow to infinity (``1e400``): not JSON.
- Integers outside signed 64 bits anywhere in the body, ignored fields included: msgpack cannot
  encode them, and no field has a use for them.
- Lone UTF-16 surrogates (``"\\ud800"``) in any string or key: they cannot be encoded as UTF-8,
  so neither the worker nor the response could carry them. Proper pairs (emoji) are fine.
- Nesting deeper than ``MAX_DEPTH`` arrays/objects. The depth is measured on the raw bytes
  before parsing (vectorized, ~10 ms per MB), so a 100,000-deep body never recurses into the
  parser. 64 levels leave room for the deepest real schema we know (a dozen levels) several
  times over.

Strings: no bound of their own besides the body limit. One long string is what a user sends to
summarize a document, and the model's context window, not the parser, is what bounds a prompt;
fields that must be short (metadata, names) are bounded where they are checked.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
from starlette.requests import Request

from .errors import ApiError, invalid

MAX_DEPTH = 64
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

_OPENERS = (ord("["), ord("{"))
_CLOSERS = (ord("]"), ord("}"))
_SCAN_CHUNK = 1 << 22
# Finding a number that may be out of range (19+ digits, or a 3-digit exponent) in a body: map
# digits to "0", e/E to "e", signs to "+", the rest to " ", then plain substring searches (a
# regex is ~30x slower on a 10 MB body). Only when one is found do the per-number hooks run,
# as they cost a Python call per number.
_NUMBER_SHAPE = bytes(ord("0") if chr(b).isdigit() and b < 128 else ord("e") if b in b"eE" else ord("+") if b in b"+-" else ord(" ") for b in range(256))
_BIG_NUMBER_MARKS = (b"0" * 19, b"e000", b"e+000")
# An unpaired surrogate escape: a high one (D800-DBFF) not followed by a low one (DC00-DFFF), or
# more low ones than high ones. Searched after dropping "\\\\" pairs, so that every "\\u" left
# is a real escape; only a hit makes the parsed body be walked to name the place. (A lookbehind
# for the lone low escape costs ~10 ms per MB; counting costs ~1.)
_LONE_HIGH = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])")
_HIGH = re.compile(rb"\\u[dD][89abAB]")
_LOW = re.compile(rb"\\u[dD][c-fC-F]")


async def read_json(request: Request, max_bytes: int) -> Any:
    """The parsed JSON body; 413 past ``max_bytes`` (checked while reading, not after), 400 for
    anything ``parse_json_bytes`` refuses."""
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
    return parse_json_bytes(raw)


def parse_json_bytes(raw: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a request body, refusing what the gateway cannot carry (see the module docstring).

    Raises ApiError 400 (``param`` names the place where practical). Also meant for code that
    reads a body before the routes do, such as the hosted-mode middleware.
    """
    try:
        encoding = json.detect_encoding(raw)
        text = raw.decode(encoding)
    except UnicodeDecodeError:
        raise invalid("The request body is not valid UTF-8.") from None
    utf8 = raw if encoding == "utf-8" else text.encode("utf-8", "surrogatepass")
    if not depth_within(utf8, max_depth):
        raise invalid(f"The request body nests arrays and objects deeper than {max_depth} levels.")
    hooks: dict[str, Any] = {"parse_constant": _refuse_constant}
    if _may_hold_big_number(utf8):
        hooks.update(parse_int=_checked_int, parse_float=_checked_float)
    try:
        value = json.loads(text, **hooks)
    except _Refused as refused:
        raise invalid(refused.message, param=_where_refused(text) or None) from None
    except json.JSONDecodeError as exc:
        raise invalid(f"We could not parse the JSON body of your request (line {exc.lineno}, column {exc.colno}).") from None
    except (ValueError, RecursionError):
        raise invalid("We could not parse the JSON body of your request.") from None
    if b"\\u" in utf8:
        unescaped = utf8.replace(b"\\\\", b"  ")
        if _LONE_HIGH.search(unescaped) or len(_LOW.findall(unescaped)) != len(_HIGH.findall(unescaped)):
            _refuse_lone_surrogates(value)
    return value


def _may_hold_big_number(raw: bytes) -> bool:
    shape = raw.translate(_NUMBER_SHAPE)
    return any(mark in shape for mark in _BIG_NUMBER_MARKS)


def depth_within(raw: bytes, limit: int) -> bool:
    """Whether the arrays/objects of JSON text ``raw`` (UTF-8) nest at most ``limit`` deep.

    Brackets inside strings do not count. Escapes are dropped first (``\\\\`` pairs, then
    ``\\"``), which leaves exactly the quotes that delimit strings for any prefix the parser would
    accept, so the depth agrees with the parser's up to the first syntax error; past it the parse
    fails anyway. Runs in chunks with numpy: bounded memory, no Python loop per byte.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return True
    arr = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    in_string = False
    depth = 0
    for start in range(0, len(arr), _SCAN_CHUNK):
        chunk = arr[start : start + _SCAN_CHUNK]
        quotes = chunk == ord('"')
        inside = np.bitwise_xor.accumulate(quotes)
        if in_string:
            inside = ~inside
        in_string ^= bool(np.count_nonzero(quotes) & 1)
        opens = (chunk == _OPENERS[0]) | (chunk == _OPENERS[1])
        closes = (chunk == _CLOSERS[0]) | (chunk == _CLOSERS[1])
        delta = opens.view(np.int8) - closes.view(np.int8)
        delta[inside] = 0
        steps = delta[delta != 0]
        if not steps.size:
            continue
        levels = np.cumsum(steps, dtype=np.int32)
        if depth + int(levels.max()) > limit:
            return False
        depth += int(levels[-1])
    return True


class _Refused(ValueError):
    """Raised inside json.loads by a hook; carries the client-facing message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _refuse_constant(name: str) -> Any:
    raise _Refused(f"The request body contains {name}, which is not valid JSON; numbers must be finite.")


def _checked_int(digits: str) -> int:
    # Length first: int() of a 5,000-digit string is itself refused by Python, with its own text.
    if len(digits.lstrip("-")) > 19 or not INT64_MIN <= int(digits) <= INT64_MAX:
        shown = digits if len(digits) <= 40 else digits[:37] + "..."
        raise _Refused(f"The request body contains the integer {shown}, which is outside the signed 64-bit range.")
    return int(digits)


def _checked_float(digits: str) -> float:
    value = float(digits)
    if not math.isfinite(value):
        shown = digits if len(digits) <= 40 else digits[:37] + "..."
        raise _Refused(f"The request body contains the number {shown}, which is too large to represent.")
    return value


class _Marker:
    """Stands in for a refused number in the second parse that locates it."""


def _mark_int(digits: str) -> Any:
    try:
        return _checked_int(digits)
    except _Refused:
        return _Marker()


def _mark_float(digits: str) -> Any:
    try:
        return _checked_float(digits)
    except _Refused:
        return _Marker()


def _where_refused(text: str) -> str | None:
    """The param of the first refused number: parsed again (only on this error path) with
    markers in place of refusals, then found by a walk."""
    try:
        marked = json.loads(text, parse_constant=lambda _: _Marker(), parse_int=_mark_int, parse_float=_mark_float)
    except ValueError:
        return None
    return _find(marked, lambda node: isinstance(node, _Marker))


def _refuse_lone_surrogates(value: Any) -> None:
    """Find the string or key with an unpaired surrogate, to name it."""
    hit = _find(value, lambda node: isinstance(node, str) and _has_lone_surrogate(node))
    where = f" in '{hit}'" if hit else ""
    raise invalid(f"The request body contains an unpaired UTF-16 surrogate escape{where}; strings must be valid Unicode.", param=hit or None)


def _find(value: Any, bad: Any) -> str | None:
    """The dotted path (``input[0].content``) of the first node for which ``bad`` holds; keys
    are tested too (a bad key names the object holding it). Iterative: depth is bounded already,
    but a walk must not depend on it. "" is the body itself; None when nothing is bad."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if bad(node):
            return path
        if isinstance(node, dict):
            items = []
            for key, item in node.items():
                if bad(key):
                    return path
                items.append((item, f"{path}.{key}" if path else str(key)))
            stack.extend(reversed(items))
        elif isinstance(node, list):
            stack.extend(reversed([(item, f"{path}[{i}]") for i, item in enumerate(node)]))
    return None


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"The request body is larger than the limit of {max_bytes} bytes.", code="request_too_large")
