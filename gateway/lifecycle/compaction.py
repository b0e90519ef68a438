"""Compaction on the gateway side: asking a worker to compact, sealing the result into a
``compaction`` item, and expanding such items back into history (spec: Compaction).

A compaction item's ``encrypted_content`` is base64url JSON holding the summary and the retained
items, so a compaction item alone stands for the whole compacted history — which is what Codex
replays. When a client replays the retained items too (the ``/responses/compact`` output lists
them before the item, a stored history after it), each is rendered once, after the summary. A
compaction of a history with nothing to summarize has an empty summary, which renders as nothing.

As the spec says, that content "is not encrypted and is treated as client data, like any input
array": it is not signed, so an item survives a restart of the server, another replica, or a
client that edits its own history; it is checked like input instead (an object with a ``summary``
string and ``retained`` input items, each checked as ``input`` items are). Items made before
this change (``kiln1.<body>.<signature>``) are read too; their signature is not needed any more.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kiln.protocol import Compact, Compacted
from kiln.protocol.usage import Usage

from ..doors.create_request import CreateRequest
from ..doors.validation import normalize_input
from ..http.errors import ApiError, invalid
from ..pool.worker_request import worker_request
from ..pool.workers import WorkerPool, routing_key
from . import truncation
from .generation import Generation, RunEvent, ask, cache_scope, count_tokens
from .sealing import PREFIX as SIGNED_PREFIX
from .sealing import b64url

DEFAULT_MAX_OUTPUT_TOKENS = 1024
SUMMARY_PREFIX = "Summary of the earlier conversation:\n"


def default_keep_tokens(context_window: int) -> int:
    return max(1, min(8192, context_window // 16))


@dataclass
class Compaction:
    item: dict[str, Any]  # the compaction output item
    kept: list[dict[str, Any]]  # system/developer messages
    retained: list[dict[str, Any]]
    usage: Usage
    input_tokens_before: int
    input_tokens_after: int
    summarized: bool = True  # False: nothing preceded the latest user message, all was retained

    @property
    def history(self) -> list[dict[str, Any]]:
        """The compacted history in stored form: kept messages, the item, retained turns."""
        return [*self.kept, self.item, *self.retained]


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def compaction_item(summary: str, retained: list[dict[str, Any]]) -> dict[str, Any]:
    content = json.dumps({"summary": summary, "retained": retained}, separators=(",", ":"), ensure_ascii=False)
    return {"id": f"cmp_{uuid.uuid4().hex}", "type": "compaction", "encrypted_content": b64url(content.encode())}


def read_compaction(content: Any, param: str) -> tuple[str, list[dict[str, Any]]]:
    """The summary and retained items of a compaction item's ``encrypted_content``: client data,
    checked as input is (400 naming ``param`` when it is not what a compaction holds)."""
    if not isinstance(content, str):
        raise invalid(f"Invalid '{param}': expected the string of a compaction item.", param=param)
    parts = content.split(".")
    if len(parts) == 3 and parts[0] == SIGNED_PREFIX:
        content = parts[1]  # made before compaction items were client data: the signature is moot
    try:
        payload = json.loads(_unb64(content))
    except (ValueError, UnicodeDecodeError, binascii.Error):
        raise invalid(f"Invalid '{param}': expected base64url JSON, as a compaction item holds.", param=param) from None
    if not isinstance(payload, dict) or not isinstance(payload.get("summary"), str) or not isinstance(payload.get("retained", []), list):
        raise invalid(f"Invalid '{param}': expected an object with a 'summary' string and a 'retained' array.", param=param)
    try:
        retained = normalize_input(payload.get("retained", []))
    except ApiError as exc:
        raise invalid(f"Invalid '{param}': its retained items are not valid input ({exc.message})", param=param) from None
    if any(r.get("type") in ("compaction", "compaction_trigger") for r in retained):
        raise invalid(f"Invalid '{param}': a compaction cannot retain another compaction.", param=param)
    return payload["summary"], retained


def expand_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replace each compaction item by the summary message and the items it retained."""
    out: list[dict[str, Any]] = []
    skip_ids: set[str] = set()
    for i, item in enumerate(items):
        if item.get("type") == "compaction":
            summary, retained = read_compaction(item.get("encrypted_content"), f"input[{i}].encrypted_content")
            skip_ids = {str(r["id"]) for r in retained if r.get("id")}
            out = [o for o in out if o.get("id") not in skip_ids]  # replayed before the item
            if summary:
                out.append({"type": "message", "role": "user", "content": SUMMARY_PREFIX + summary})
            out.extend(retained)
            continue
        if item.get("id") in skip_ids:
            continue  # the client replayed a retained item the compaction already carries
        out.append(item)
    return out


async def compact(
    pool: WorkerPool, request: CreateRequest, model: str, *, keep_tokens: int, max_output_tokens: int, timeout_s: float | None = None, session: str | None = None, owner: Any = None
) -> Compaction:
    """Have a worker compact ``request.input`` (stored form; expanded here before sending).
    ``owner``: whose history it is; its summary's prompt goes into that organization's prefix
    cache scope, as its generations do (never one another organization's lookups could reach)."""
    items = expand_items(request.input)
    sent = dataclasses.replace(worker_request(request, items), cache_scope=cache_scope(owner))
    message = await ask(pool, model, routing_key(request, session), lambda req_id: Compact(req_id, sent, keep_tokens, max_output_tokens), timeout_s)
    if not isinstance(message, Compacted):
        raise ApiError(502, "The worker answered a compaction with something else.")
    retained = [_with_id(items[i]) for i in message.retained_indices]
    whole = [i for i in items if i.get("type") != "compaction_trigger"]
    usage = Usage(input_tokens=message.usage.input_tokens, output_tokens=message.usage.output_tokens)
    return Compaction(
        item=compaction_item(message.summary, retained),
        kept=[items[i] for i in message.kept_indices],
        retained=retained,
        usage=usage,
        input_tokens_before=message.input_tokens_before,
        input_tokens_after=message.input_tokens_after,
        summarized=len(message.kept_indices) + len(message.retained_indices) < len(whole),
    )


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    return item if item.get("id") else {**item, "id": f"item_{uuid.uuid4().hex}"}


def compact_resource(result: Compaction, model: str) -> dict[str, Any]:
    """The body of ``POST /v1/responses/compact``: the kept system and developer messages, the
    retained items, then the compaction item (the spec's order, and OpenAI's), every item in its
    output form so that the object validates against OpenAI's ``CompactResource``."""
    return {
        "id": f"cmpr_{uuid.uuid4().hex}",
        "object": "response.compaction",
        "created_at": int(time.time()),
        "model": model,
        "output": [*(output_form(i) for i in (*result.kept, *result.retained)), result.item],
        "usage": result.usage.to_map(),
    }


def output_form(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as an output item: an id and a status, a message's content as a list of parts
    (a user, system or developer message keeps its input types; an assistant's output text gets
    the annotations and logprobs every output text has)."""
    out = _with_id({**item, "type": item.get("type") or "message"})
    if out["type"] in ("message", "function_call", "function_call_output", "reasoning"):
        out.setdefault("status", "completed")
    if out["type"] == "reasoning":
        out.setdefault("summary", [])
    if out["type"] == "message":
        content = out.get("content")
        if isinstance(content, str):
            content = [{"type": "output_text" if out.get("role") == "assistant" else "input_text", "text": content}]
        out["content"] = [{"annotations": [], "logprobs": [], **part} if part.get("type") == "output_text" else part for part in content or []]
    return out


def compaction_settings(entries: Any) -> int | None:
    """The auto-compaction threshold of ``context_management`` (``entries``), validated; None
    when absent."""
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


async def compaction_phase(pool: WorkerPool, generation: Generation, timeout_s: float) -> None:
    """Run what must happen before generation: a ``compaction_trigger`` turn (the whole
    answer is one compaction item) or automatic compaction over ``context_management``'s
    threshold. Raises ApiError when compaction fails."""
    request, model = generation.request, generation.model
    window = pool.context_window(model) or 0
    items = request.input
    if items and items[-1].get("type") == "compaction_trigger":
        result = await compact(pool, request.with_input(items[:-1]), model, keep_tokens=default_keep_tokens(window), max_output_tokens=DEFAULT_MAX_OUTPUT_TOKENS, timeout_s=timeout_s,
            session=generation.options.session, owner=generation.owner)
        generation.answer_without_worker(result.item, result.usage)
        return
    if request.truncation == "auto":  # accepted only with --truncation-auto
        count = truncation.worker_count(pool, request, model, timeout_s, generation.options)
        generation.wire_input = await truncation.fit(generation.wire_input, count, window)
    threshold = generation.compact_threshold
    if threshold is None:
        return
    counted = await count_tokens(pool, request, generation.wire_input, model, timeout_s, generation.options)
    if counted < threshold and counted < window - 1:
        return
    rid = generation.response.id
    result = await compact(pool, request, model, keep_tokens=default_keep_tokens(window), max_output_tokens=DEFAULT_MAX_OUTPUT_TOKENS, timeout_s=timeout_s, session=generation.options.session,
        owner=generation.owner)
    if not result.summarized:  # asked for to make room, it made none
        raise ApiError(400, "Compaction cannot shorten this input: there is nothing before the latest user message to summarize.", code="context_length_exceeded", param="input")
    events: list[RunEvent] = [
        {"type": "mlx.compaction.started", "response_id": rid, "input_tokens": counted},
        {"type": "mlx.compaction.completed", "response_id": rid, "input_tokens_before": result.input_tokens_before, "input_tokens_after": result.input_tokens_after},
    ]
    generation.compacted(result.history, expand_items(result.history), result.usage, events, result.item)
