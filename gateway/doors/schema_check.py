"""Create-time checks for structured output: ``text.format`` and JSON schemas.

A schema the worker cannot enforce must be refused when the request arrives, with a 400 that
names the problem, not discovered mid-generation on a worker. So the gateway runs here the same
grammar compiler the worker uses (llguidance), but only its tokenizer-free half: turning the
schema into a grammar and validating that grammar. That half does not need mlx, so the gateway
stays free of it.

Bounds: a schema larger than ``MAX_SCHEMA_BYTES`` serialized or nesting deeper than
``MAX_SCHEMA_DEPTH`` objects/arrays is refused before any parsing work, and grammar validation
runs under llguidance's fuel limits and a wall-clock bound, so a hostile schema cannot stall the
request path. The depth bound is what keeps jsonschema's metaschema validation (recursive, several
Python frames per level) far from the interpreter's recursion limit: it fails near 240 levels.
Real schemas nest about a dozen levels (OpenAI allows 10 levels of objects, ~20 here, as each
object level is a schema plus its ``properties``); 40 is twice that. It sits below the 64 levels
that request bodies are bounded at when parsed (kiln.gateway.http.body), so a too-deep tool or format
schema is refused naming its parameter; the bound also covers schemas built in code.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from kiln.gateway.http.errors import invalid
from kiln.protocol.grammar import SchemaUse, schema_error

MAX_SCHEMA_BYTES = 256 * 1024
MAX_SCHEMA_DEPTH = 40
COMPILE_TIMEOUT_S = 2.0
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ROOT_URI = "urn:kiln:schema"

# Keywords whose values are data, not subschemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "x-guidance"})

# Digests of schemas (serialized) that passed every check: a client sends the same schema on every
# request, and the checks cost milliseconds on the event loop (the metaschema most of it).
_ACCEPTED: OrderedDict[bytes, None] = OrderedDict()
_ACCEPTED_LIMIT = 512

# Grammar validation releases the GIL; a small pool lets us bound its wall time.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="schema-check")


def check_text_format(fmt: dict[str, Any] | None, *, param: str = "text.format") -> None:
    """Refuse a ``text.format`` the worker could not enforce; ``None`` and text pass.

    Accepted shapes: ``{"type": "text"}``, ``{"type": "json_object"}`` and
    ``{"type": "json_schema", "name", "schema", "strict"?, "description"?}``.
    """
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise invalid(f"'{param}' must be an object, got {_kind(fmt)}.", param=param)
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return
    if kind != "json_schema":
        raise invalid(f"'{param}.type' must be one of 'text', 'json_object', 'json_schema'; got {kind!r}.", param=f"{param}.type")
    name = fmt.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise invalid(f"'{param}.name' is required: 1-64 characters of a-z, A-Z, 0-9, '_' or '-'.", param=f"{param}.name")
    if "strict" in fmt and fmt["strict"] is not None and not isinstance(fmt["strict"], bool):
        raise invalid(f"'{param}.strict' must be a boolean.", param=f"{param}.strict")
    if "description" in fmt and fmt["description"] is not None and not isinstance(fmt["description"], str):
        raise invalid(f"'{param}.description' must be a string.", param=f"{param}.description")
    if "schema" not in fmt:
        raise invalid(f"'{param}.schema' is required for type 'json_schema'.", param=f"{param}.schema")
    check_json_schema(fmt["schema"], param=f"{param}.schema")


def check_json_schema(schema: Any, *, param: str, use: SchemaUse = "text_format") -> None:
    """Refuse a JSON schema that is malformed, too big, has a dangling ``$ref`` or cannot compile.

    Reused for function-tool ``parameters`` (``use="tool_arguments"``), which the worker
    enforces with a grammar when a tool call is forced; ``use`` picks the compile options both
    daemons share (kiln.protocol.grammar), so they accept the same schemas.
    """
    if not isinstance(schema, dict):
        raise invalid(f"'{param}' must be a JSON schema object, got {_kind(schema)}.", param=param)
    if _nests_deeper_than(schema, MAX_SCHEMA_DEPTH):
        raise invalid(f"'{param}' nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels.", param=param)
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        raise invalid(f"'{param}' is not serializable JSON.", param=param) from None
    size = len(text.encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        raise invalid(f"'{param}' is {size} bytes serialized; the limit is {MAX_SCHEMA_BYTES} bytes.", param=param)
    digest = hashlib.sha256(use.encode() + b"\0" + text.encode("utf-8")).digest()
    if digest in _ACCEPTED:
        _ACCEPTED.move_to_end(digest)
        return
    _check_metaschema(schema, param)
    _check_refs(schema, param)
    _check_compiles(text, param, use)
    _ACCEPTED[digest] = None
    if len(_ACCEPTED) > _ACCEPTED_LIMIT:
        _ACCEPTED.popitem(last=False)


def _jsonschema() -> ModuleType:
    """jsonschema, imported on first use rather than with the gateway. With its format extras
    installed (``jsonschema[format-nongpl]``, which the test extra and ``./dev`` bring),
    importing it builds rfc3987-syntax's grammar: 1.5-3.3 s, most of the gateway's start and so
    of ``kiln serve``'s time to ready. ``preload`` imports it in the background once the app
    serves, so the first schema seldom waits for it."""
    return importlib.import_module("jsonschema")


def preload() -> None:
    """Import jsonschema on a daemon thread (see ``_jsonschema``): the import lock makes a
    request that needs it meanwhile wait for this import, never run a second one."""
    threading.Thread(target=_jsonschema, name="jsonschema-import", daemon=True).start()


def _check_metaschema(schema: dict[str, Any], param: str) -> None:
    """Validate against the Draft 2020-12 metaschema; name the failing keyword's location."""
    jsonschema = _jsonschema()
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except RecursionError:  # unreachable within MAX_SCHEMA_DEPTH; a 400 all the same
        raise invalid(f"'{param}' nests too deeply to be validated.", param=param) from None
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        at = f" at '{where}'" if where else ""
        raise invalid(f"'{param}' is not a valid JSON Schema (Draft 2020-12){at}: {exc.message}", param=param) from None


def _nests_deeper_than(node: Any, limit: int) -> bool:
    """Whether ``node`` nests dicts/lists more than ``limit`` deep; iterative, so any depth is safe."""
    stack: list[tuple[Any, int]] = [(node, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))
    return False


def _check_refs(schema: dict[str, Any], param: str) -> None:
    """Every ``$ref`` must resolve inside the schema; we never fetch remote documents."""
    registry: Registry = Registry().with_resource(_ROOT_URI, Resource.from_contents(schema, default_specification=DRAFT202012))
    root = registry.resolver(base_uri=_ROOT_URI)
    for ref, resolver in _refs(schema, root):
        try:
            resolver.lookup(ref)
        except Unresolvable:
            raise invalid(f"'{param}' has a $ref that cannot be resolved: {ref!r}.", param=param) from None


def _refs(node: Any, resolver: Any) -> Iterator[tuple[str, Any]]:
    """Yield each ``$ref`` with the resolver scoped to its enclosing ``$id``."""
    if isinstance(node, list):
        for item in node:
            yield from _refs(item, resolver)
        return
    if not isinstance(node, dict):
        return
    if isinstance(node.get("$id"), str):
        resolver = resolver.in_subresource(Resource.from_contents(node, default_specification=DRAFT202012))
    ref = node.get("$ref")
    if isinstance(ref, str):
        yield ref, resolver
    for key, value in node.items():
        if key not in _DATA_KEYWORDS:
            yield from _refs(value, resolver)


def _check_compiles(schema_text: str, param: str, use: SchemaUse) -> None:
    """Run llguidance's tokenizer-free grammar validation under fuel and time bounds."""
    future = _POOL.submit(_validate_grammar, schema_text, use)
    try:
        error = future.result(timeout=COMPILE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        raise invalid(f"'{param}' is too complex: compiling it took longer than {COMPILE_TIMEOUT_S:g}s.", param=param) from None
    if error:
        raise invalid(f"'{param}' cannot be enforced: {error}", param=param)


def _validate_grammar(schema_text: str, use: SchemaUse) -> str:
    """Return llguidance's error message for the schema, or '' if it compiles."""
    error = schema_error(schema_text, use)
    return _clean(error) if error else ""


def _clean(message: str) -> str:
    """llguidance messages can be long multi-line traces; keep the client-useful head."""
    message = message.strip()
    return message if len(message) <= 500 else message[:497] + "..."


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)

