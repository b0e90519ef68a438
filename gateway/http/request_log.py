"""An opt-in request log: one JSON line per ``/responses`` request, for debugging clients.

Set ``KILN_REQUEST_LOG=/path/to/file.jsonl`` and every ``POST /v1/responses`` (and
``/v1/responses/compact``) appends one line: the time, path, status, the input item count and types,
``prompt_cache_key``, the request kind Codex names in ``client_metadata``, the tool types, a hash of
each input item (so a test or a person can see that turn 2 replays turn 1), and from the answer the
terminal event (``response.completed`` / ``failed`` / ``incomplete``), its usage, and the error
message of a non-2xx answer. Bodies are not logged (prompts stay out of the file) unless
``KILN_REQUEST_LOG_BODIES=1`` is set too, for replaying a client's request by hand.

Off unless the variable is set; ``install_request_log(app)`` is the hook ``create_app`` calls.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from os import PathLike
from typing import IO, Any

from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ENV = "KILN_REQUEST_LOG"
BODIES_ENV = "KILN_REQUEST_LOG_BODIES"
_PATHS = re.compile(r"^(/v1)?/responses(/compact)?/?$")
_TERMINAL = ("response.completed", "response.failed", "response.incomplete")
_TAIL = 64 << 10  # bytes of the answer kept to find its terminal event


def item_hash(item: Any) -> str:
    """A short, stable hash of one input item (keys sorted), comparable across requests."""
    return hashlib.sha256(json.dumps(item, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def summarize_request(path: str, body: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"path": path}
    if not isinstance(body, dict):
        entry["body_error"] = "not a JSON object"
        return entry
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    items = items if isinstance(items, list) else []
    meta: dict[str, Any] = body["client_metadata"] if isinstance(body.get("client_metadata"), dict) else {}
    kind = meta.get("request_kind")
    if kind is None and isinstance(meta.get("x-codex-turn-metadata"), str):
        try:
            kind = json.loads(meta["x-codex-turn-metadata"]).get("request_kind")
        except ValueError:
            pass
    entry.update(
        model=body.get("model"),
        stream=bool(body.get("stream")),
        prompt_cache_key=body.get("prompt_cache_key"),
        request_kind=kind,
        input_count=len(items),
        input_types=[_item_type(i) for i in items],
        input_hashes=[item_hash(i) for i in items],
        tool_types=[t.get("type") for t in body.get("tools") or [] if isinstance(t, dict)],
        instructions_chars=len(body["instructions"]) if isinstance(body.get("instructions"), str) else 0,
    )
    return entry


def _item_type(item: Any) -> str:
    if not isinstance(item, dict):
        return type(item).__name__
    kind = item.get("type") or ("message" if "role" in item else "?")
    return f"{kind}:{item['role']}" if kind == "message" and "role" in item else str(kind)


def summarize_answer(status: int, content_type: str, tail: bytes) -> dict[str, Any]:
    """What the answer said: the terminal SSE event and usage, or the error of a JSON body."""
    out: dict[str, Any] = {"status": status}
    text = tail.decode("utf-8", "replace")
    if "text/event-stream" in content_type:
        for line in reversed(text.splitlines()):
            if not line.startswith("data: "):
                continue
            try:
                event = json.loads(line[6:])
            except ValueError:
                continue
            if event.get("type") in _TERMINAL:
                response = event.get("response") or {}
                out["terminal"] = event["type"]
                out["usage"] = response.get("usage")
                out["output_types"] = [o.get("type") for o in response.get("output") or [] if isinstance(o, dict)]
                if response.get("error"):
                    out["error"] = response["error"]
                break
        return out
    try:
        body = json.loads(text)
    except ValueError:
        return out
    if isinstance(body, dict):
        if status >= 400 and "error" in body:
            out["error"] = body["error"]
        if "usage" in body:
            out["usage"] = body["usage"]
        if isinstance(body.get("output"), list):
            out["output_types"] = [o.get("type") for o in body["output"] if isinstance(o, dict)]
    return out


@dataclass
class _Answer:
    """What the response said, as far as the log needs it."""

    status: int = 0
    content_type: str = ""
    tail: bytes = b""


class RequestLogMiddleware:
    """ASGI middleware appending one JSON line per ``/responses`` request to ``path``."""

    def __init__(self, app: ASGIApp, path: str, bodies: bool | None = None) -> None:
        self.app = app
        self.path = path
        self.bodies = os.environ.get(BODIES_ENV, "") not in ("", "0") if bodies is None else bodies
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not _PATHS.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        buffered: list[Message] = []
        while more:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)

        async def replay() -> Message:
            if buffered:
                return buffered.pop(0)
            return await receive()

        try:
            body = json.loads(b"".join(chunks) or b"null")
        except (ValueError, RecursionError):  # a deeply nested body must not turn into a 500 here
            body = None
        entry = {"ts": round(time.time(), 3), **summarize_request(scope["path"], body)}
        if self.bodies:
            entry["body"] = body
        answer = _Answer()

        async def tap(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                for key, value in message.get("headers", []):
                    if key.lower() == b"content-type":
                        answer.content_type = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                answer.tail = (answer.tail + message.get("body", b""))[-_TAIL:]
            await send(message)

        try:
            await self.app(scope, replay, tap)
        finally:
            entry.update(summarize_answer(answer.status, answer.content_type, answer.tail))
            entry["seconds"] = round(time.time() - entry["ts"], 3)
            try:
                line = json.dumps(entry, default=str) + "\n"
            except (ValueError, RecursionError):
                entry.pop("body", None)
                line = json.dumps(entry, default=str) + "\n"
            with self._lock, _open_private(self.path) as f:
                f.write(line)


def _open_private(path: str) -> IO[str]:
    """Append to the log, creating it owner-only: with bodies on it holds the clients' prompts."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a", encoding="utf-8")


def install_request_log(app: Starlette, path: str | None = None) -> None:
    """Add the request log to a Starlette app when ``path`` (default: $KILN_REQUEST_LOG) is set."""
    path = path or os.environ.get(ENV)
    if not path or getattr(app.state, "request_log", None):
        return
    app.add_middleware(RequestLogMiddleware, path=path)
    app.state.request_log = path


def read_log(path: str | PathLike[str]) -> list[dict[str, Any]]:
    """The entries of a request log file (for tests)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []

