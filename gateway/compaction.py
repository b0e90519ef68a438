"""Compaction on the gateway side: asking a worker to compact, sealing the result into a
``compaction`` item, and expanding such items back into history (spec: Compaction).

A compaction item's ``encrypted_content`` is a sealed blob (see sealing.py) holding the summary
and the retained items, so a compaction item alone stands for the whole compacted history — which
is what Codex replays. When a client replays the retained items after the item as well (the
``/responses/compact`` output), the duplicates are skipped.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from kiln.protocol import Compact, Compacted, Failed
from kiln.protocol.usage import Usage

from .errors import ApiError, invalid
from .generation import reply
from .sealing import SealError, Sealer
from .worker_request import worker_request
from .workers import NoWorker, WorkerPool, routing_key

DEFAULT_MAX_OUTPUT_TOKENS = 1024
SUMMARY_PREFIX = "Summary of the earlier conversation:\n"


def default_keep_tokens(context_window: int) -> int:
    return max(1, min(8192, context_window // 16))


@dataclass
class Compaction:
    item: dict[str, Any]  # the compaction output item
    kept: list[dict[str, Any]]  # system/developer messages
    retained: list[dict[str, Any]]
    usage: dict[str, Any]
    input_tokens_before: int
    input_tokens_after: int

    @property
    def history(self) -> list[dict[str, Any]]:
        """The compacted history in stored form: kept messages, the item, retained turns."""
        return [*self.kept, self.item, *self.retained]


def compaction_item(sealer: Sealer, summary: str, retained: list[dict]) -> dict[str, Any]:
    blob = sealer.seal("compaction", {"summary": summary, "retained": retained})
    return {"id": f"cmp_{uuid.uuid4().hex}", "type": "compaction", "encrypted_content": blob}


def expand_items(items: list[dict], sealer: Sealer) -> list[dict]:
    """Replace each compaction item by the summary message and the items it retained."""
    out: list[dict] = []
    skip_ids: set[str] = set()
    for i, item in enumerate(items):
        if item.get("type") == "compaction":
            try:
                payload = sealer.unseal("compaction", item.get("encrypted_content"))
            except SealError as exc:
                raise invalid(f"'input[{i}].encrypted_content' is not a compaction produced by this server, or it was altered ({exc}).", param=f"input[{i}].encrypted_content")
            out.append({"type": "message", "role": "user", "content": SUMMARY_PREFIX + payload.get("summary", "")})
            retained = payload.get("retained") or []
            out.extend(retained)
            skip_ids = {r.get("id") for r in retained if r.get("id")}
            continue
        if item.get("id") in skip_ids:
            continue  # the client replayed a retained item the compaction already carries
        out.append(item)
    return out


async def compact(pool: WorkerPool, sealer: Sealer, body: dict, model: str, *, keep_tokens: int, max_output_tokens: int, timeout_s: float | None = None, session: str | None = None) -> Compaction:
    """Have a worker compact ``body["input"]`` (stored form; expanded here before sending)."""
    stored = body["input"]
    wire = {**body, "input": expand_items(stored, sealer)}
    request = worker_request(wire)
    try:
        worker = pool.pick(model, routing_key(body, session))
    except NoWorker:
        raise ApiError(503, f"No worker is serving model '{model}' right now.", code="server_is_overloaded")
    req_id = uuid.uuid4().hex
    channel = await pool.open(worker, req_id, Compact(req_id, request, keep_tokens, max_output_tokens))
    try:
        message = await reply(channel, timeout_s)
    finally:
        pool.close(channel, cancel=not channel.finished)
    if isinstance(message, Failed):
        raise ApiError(message.http_status, message.message, code=message.code, param=message.param)
    if not isinstance(message, Compacted):
        raise ApiError(502, "The worker answered a compaction with something else.")
    items = wire["input"]
    retained = [_with_id(items[i]) for i in message.retained_indices]
    summary = Usage.from_map(message.usage)
    usage = Usage(input_tokens=summary.input_tokens, output_tokens=summary.output_tokens).to_map()
    return Compaction(
        item=compaction_item(sealer, message.summary, retained),
        kept=[items[i] for i in message.kept_indices],
        retained=retained,
        usage=usage,
        input_tokens_before=message.input_tokens_before,
        input_tokens_after=message.input_tokens_after,
    )


def _with_id(item: dict) -> dict:
    return item if item.get("id") else {**item, "id": f"item_{uuid.uuid4().hex}"}


def compact_resource(result: Compaction, model: str) -> dict[str, Any]:
    """The body of ``POST /v1/responses/compact``."""
    return {
        "id": f"cmpr_{uuid.uuid4().hex}",
        "object": "response.compaction",
        "created_at": int(time.time()),
        "model": model,
        "output": [*result.kept, result.item, *result.retained],
        "usage": result.usage,
    }


def compaction_settings(body: dict) -> int | None:
    """The auto-compaction threshold of ``context_management``, validated; None when absent."""
    entries = body.get("context_management")
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise invalid("Invalid 'context_management': expected an array.", param="context_management")
    threshold = None
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("type") != "compaction":
            raise invalid(f"Invalid 'context_management[{i}]': only {{\"type\": \"compaction\"}} is supported.", param=f"context_management[{i}]")
        n = entry.get("compact_threshold")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 100_000_000:
            raise invalid(f"Invalid 'context_management[{i}].compact_threshold': expected an integer from 1 to 100000000.", param=f"context_management[{i}].compact_threshold")
        threshold = n
    return threshold
