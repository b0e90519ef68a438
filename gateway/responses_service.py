"""The life of a response: create (foreground or background), store, retrieve, cancel, delete.

Routes stay thin HTTP adapters; this class owns the state that spans requests — the response
store, conversation transcripts, background jobs and the registry of in-flight responses that
``cancel`` can reach. The stores are the Protocols of ``store/protocols.py`` (``store/backend.py``
builds them), so nothing here depends on whether they live in this process or in Redis shared by
several replicas; what differs across replicas is only *where* a job or an in-flight response
runs, which ``jobs.get`` / ``live.get`` tell and ``cancel_elsewhere`` reaches.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

from kiln.protocol.usage import Usage

from . import compaction, truncation
from .door_options import NO_OPTIONS, DoorOptions
from .errors import ApiError, invalid
from .generation import Generation, GenerationFailed, complete_usage, count_tokens, terminal_event
from .history import TERMINAL, check_call_outputs, conversation_id, conversation_key, expand
from .response_object import ResponseObject, new_response_id, zero_usage
from .metrics import GenerationTimer
from .sealing import SealError, Sealer
from .settings import Settings
from .store.backend import build_stores
from .store.background import Job, job_view
from .store.conversations import as_input_item
from .store.lru import OWNER_SHARE, approx_bytes
from .store.protocols import JobState, ResponseStore, StoreUnavailable
from .store.responses import StoredResponse
from .validation import check_for_model
from .worker_request import check_sampling
from .workers import NoWorker, WorkerPool, routing_key

log = logging.getLogger("kiln.gateway.responses")

# Failure codes of a background job, as the spec lists them.
_JOB_CODES = {
    "server_is_overloaded": "server_overloaded",
    "context_length_exceeded": "invalid_prompt",
    "invalid_prompt": "invalid_prompt",
    "invalid_request_error": "invalid_prompt",
}
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs", "compaction": "cmp"}


def _with_ids(items: list[dict]) -> list[dict]:
    """Input items as the input_items endpoint lists them: each with an id, message content as
    a list of parts."""
    out = []
    for item in items:
        if item.get("type") == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item = {**item, "content": [{"type": part, "text": item["content"]}]}
        if not item.get("id"):
            item = {**item, "id": f"{_ID_PREFIX.get(str(item.get('type')), 'item')}_{uuid.uuid4().hex}"}
        out.append(item)
    return out


class ResponsesService:
    def __init__(self, settings: Settings, pool: WorkerPool) -> None:
        self.settings = settings
        self.pool = pool
        self.stores = build_stores(settings)
        self.store: ResponseStore | None = self.stores.responses
        self.conversations = self.stores.conversations
        self.jobs = self.stores.jobs
        self.reasoning_echo = self.stores.reasoning_echo
        self.items = self.stores.items  # item id -> the stored response or conversation holding it
        self.event_buffers = self.stores.events  # numbered events, for stream=true GETs
        self.live = self.stores.live  # foreground responses in flight on other replicas
        self.inflight: dict[str, Generation] = {}  # foreground responses in flight here
        self.sealer = Sealer(settings.secret_key, encrypt=settings.encrypt_reasoning)
        self.metrics: Any = None  # set by the app when /metrics is mounted

    async def open(self) -> None:
        """Start what the stores run beside requests (Redis: leases, sweeper, cancel listener)."""
        await self.stores.open(self._cancel_here)

    async def close(self) -> None:
        """Shutting down: this replica's jobs end ``failed`` now (stored, so that a poll on
        another replica sees it at once rather than after the lease), then the stores close."""
        jobs = list(self.jobs.active.values())
        for job in jobs:
            job.extra["shutdown"] = True
            job.generation.cancel()
            if job.task is not None:
                job.task.cancel()
        await asyncio.gather(*(job.task for job in jobs if job.task is not None), return_exceptions=True)
        await self.stores.close()

    async def stats(self) -> dict[str, Any]:
        """What /health shows of the stores."""
        stats: dict[str, Any] = {"backend": self.stores.mode}
        try:
            stats["responses"] = await self.store.stats() if self.store is not None else None
        except StoreUnavailable:
            stats["responses"] = {"available": False}
        stats["background"] = await self.jobs.stats()
        return stats

    # -- create ----------------------------------------------------------------------------------
    async def prepare(self, body: dict, owner: Any = None, *, history: list[dict] | None = None, options: DoorOptions = NO_OPTIONS) -> tuple[Generation, list[dict]]:
        """Resolve the model and history; everything that can refuse the request happens here.

        ``body``: client fields only (``validate_create``); ``options``: what the door decided.
        ``history``: what ``previous_response_id`` names, already resolved by the door (a
        WebSocket connection's own state); None resolves it from the stores."""
        model = self.pool.require(body["model"])  # 404, or 503 while its worker restarts
        body["model"] = model
        window = self.pool.context_window(model)
        if options.cap_to_window and window and (body.get("max_output_tokens") or 0) > window:
            body["max_output_tokens"] = window
        check_for_model(body, window)
        check_sampling(body)
        if body["background"]:
            self._check_background_allowed()
        own_input = _with_ids(self.unseal_items(await self.resolve_references(body["input"], owner)))
        if history is None:
            history = await expand(body, store=self.store, jobs=self.jobs, conversations=self.conversations, store_mode=self.settings.store_mode, owner=owner)
        body["input"] = await self.reasoning_echo.restore(history + own_input, owner)
        if not body["input"]:
            raise invalid("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
        generation = Generation(
            self.pool,
            ResponseObject(new_response_id(), body, model, echo_background=self.settings.echo_background),
            body,
            model,
            options=options,
            owner=owner,
            wire_input=compaction.expand_items(body["input"]),
            compact_threshold=compaction.compaction_settings(body),
            first_event_timeout_s=self.settings.first_event_timeout_s,
            event_timeout_s=self.settings.event_timeout_s,
            item_hook=self.seal_reasoning if "reasoning.encrypted_content" in (body.get("include") or []) else None,
        )
        check_call_outputs(generation.wire_input)
        return generation, own_input

    async def count_input_tokens(self, body: dict, owner: Any = None, options: DoorOptions = NO_OPTIONS) -> int:
        """The prompt's length in tokens, rendered as a create with the same body would be
        (history, item references, sealed reasoning, the reasoning echo, compaction items): the
        one counter behind ``/v1/responses/input_tokens`` and ``/v1/messages/count_tokens``."""
        model = self.pool.require(body["model"])  # 404, or 503 while its worker restarts
        body = {**body, "model": model}
        history = await expand(body, store=self.store, jobs=self.jobs, conversations=self.conversations, store_mode=self.settings.store_mode, owner=owner)
        own = self.unseal_items(await self.resolve_references(body["input"], owner))
        items = compaction.expand_items(await self.reasoning_echo.restore(history + own, owner))
        return await count_tokens(self.pool, {**body, "input": items}, model, self.settings.first_event_timeout_s, options)

    # -- item references -------------------------------------------------------------------------
    async def resolve_references(self, items: list[dict], owner: Any = None) -> list[dict]:
        """``item_reference`` items replaced by the items they name: input or output items of the
        owner's stored responses, or items of the owner's conversations. An id that names
        nothing the owner may see is a 400 naming it (never silently dropped)."""
        if not any(i.get("type") == "item_reference" for i in items):
            return items
        out = []
        for i, item in enumerate(items):
            if item.get("type") != "item_reference":
                out.append(item)
                continue
            item_id = item.get("id")
            if not isinstance(item_id, str) or not item_id:
                raise invalid(f"Missing or invalid 'input[{i}].id': an item_reference names a stored item by id.", param=f"input[{i}].id")
            found = await self._find_item(item_id, owner)
            if found is None:
                raise invalid(f"Item with id '{item_id}' not found.", param=f"input[{i}].id", code="item_not_found")
            out.append(as_input_item(found))
        return out

    async def _find_item(self, item_id: str, owner: Any) -> dict | None:
        where = await self.items.lookup(owner, item_id)
        if where is None:
            return None
        kind, key = where
        if kind == "response":
            stored = await self.store.get(key) if self.store is not None else None
            if stored is None or stored.ephemeral or stored.extra.get("owner") != owner:
                return None
            pool = list(stored.input_items) + list(stored.response.get("output") or [])
        else:
            conv = await self.conversations.get(key)
            if conv is None:
                return None
            pool = conv.items
        return next((dict(i) for i in pool if i.get("id") == item_id), None)

    # -- compaction ------------------------------------------------------------------------------
    async def compaction_phase(self, generation: Generation) -> None:
        """Run what must happen before generation: a ``compaction_trigger`` turn (the whole
        answer is one compaction item) or automatic compaction over ``context_management``'s
        threshold. Raises ApiError when compaction fails."""
        body, model = generation.body, generation.model
        window = self.pool.context_window(model) or 0
        items = body["input"]
        if items and items[-1].get("type") == "compaction_trigger":
            result = await compaction.compact(self.pool, {**body, "input": items[:-1]}, model, keep_tokens=compaction.default_keep_tokens(window), max_output_tokens=compaction.DEFAULT_MAX_OUTPUT_TOKENS, timeout_s=self.settings.first_event_timeout_s, session=generation.options.session, owner=generation.owner)
            generation.add_prefix_item(result.item)
            generation.done_without_worker = True
            generation.response.finish("completed", complete_usage(result.usage))
            return
        if body.get("truncation") == "auto":  # accepted only with --truncation-auto
            count = truncation.worker_count(self.pool, body, model, self.settings.first_event_timeout_s, generation.options)
            generation.wire_input = await truncation.fit(generation.wire_input, count, window)
        threshold = generation.compact_threshold
        if threshold is None:
            return
        counted = await count_tokens(self.pool, {**body, "input": generation.wire_input}, model, self.settings.first_event_timeout_s, generation.options)
        if counted < threshold and counted < window - 1:
            return
        rid = generation.response.id
        result = await compaction.compact(self.pool, body, model, keep_tokens=compaction.default_keep_tokens(window), max_output_tokens=compaction.DEFAULT_MAX_OUTPUT_TOKENS, timeout_s=self.settings.first_event_timeout_s, session=generation.options.session, owner=generation.owner)
        if not result.summarized:  # asked for to make room, it made none
            raise ApiError(400, "Compaction cannot shorten this input: there is nothing before the latest user message to summarize.", code="context_length_exceeded", param="input")
        generation.compaction_usage = Usage.from_map(result.usage)  # billed with the response
        body["input"] = result.history
        generation.wire_input = compaction.expand_items(result.history)
        generation.prefix_events.append({"type": "mlx.compaction.started", "response_id": rid, "input_tokens": counted})
        generation.prefix_events.append({"type": "mlx.compaction.completed", "response_id": rid, "input_tokens_before": result.input_tokens_before, "input_tokens_after": result.input_tokens_after})
        generation.add_prefix_item(result.item)

    async def compact_endpoint(self, body: dict, keep_tokens: Any = None, owner: Any = None) -> dict:
        """``POST /v1/responses/compact`` (the route refused stream and history fields): nothing
        is stored; ``item_reference`` items are resolved as on create. ``keep_tokens``: the
        endpoint's own field, as the client sent it (None: the model's default)."""
        model = self.pool.require(body["model"])  # 404, or 503 while its worker restarts
        window = self.pool.context_window(model) or 0
        keep = compaction.default_keep_tokens(window) if keep_tokens is None else keep_tokens
        if isinstance(keep, bool) or not isinstance(keep, int) or keep <= 0:
            raise invalid("Invalid 'keep_tokens': expected an integer above 0.", param="keep_tokens")
        max_out = body.get("max_output_tokens") or compaction.DEFAULT_MAX_OUTPUT_TOKENS
        body = {**body, "model": model, "input": _with_ids(self.unseal_items(await self.resolve_references(body["input"], owner)))}
        result = await compaction.compact(self.pool, body, model, keep_tokens=keep, max_output_tokens=max_out, timeout_s=self.settings.first_event_timeout_s, owner=owner)
        return compaction.compact_resource(result, model)

    # -- sealed content --------------------------------------------------------------------------
    def seal_reasoning(self, item: dict) -> dict:
        if item.get("type") != "reasoning":
            return item
        text = "".join(c.get("text", "") for c in item.get("content") or [])
        return {**item, "encrypted_content": self.sealer.seal("reasoning", {"text": text})}

    def unseal_items(self, items: list[dict]) -> list[dict]:
        """Reasoning carried back in ``encrypted_content`` becomes renderable content again.

        A blob in Kiln's format that fails verification is refused; another server's blob (a
        client that switched providers) cannot be read, so it is dropped.
        """
        out = []
        for i, item in enumerate(items):
            blob = item.get("encrypted_content")
            if item.get("type") == "reasoning" and blob:
                if not self.sealer.is_ours(blob):
                    item = {k: v for k, v in item.items() if k != "encrypted_content"}
                else:
                    try:
                        payload = self.sealer.unseal("reasoning", blob)
                    except SealError as exc:
                        raise invalid(f"'input[{i}].encrypted_content' was not produced by this server or was altered ({exc}).", param=f"input[{i}].encrypted_content")
                    item = {**item, "content": [{"type": "reasoning_text", "text": payload.get("text", "")}]}
            out.append(item)
        return out

    def _check_background_allowed(self) -> None:
        s = self.settings
        if self.store is None or not self.store.enabled:
            raise invalid("'background' needs the response store, which is disabled on this server.", param="background")
        if s.responses_background_max_jobs == 0 or s.responses_store_max_bytes == 0:
            raise invalid("Background mode is disabled on this server.", param="background")

    async def start_foreground(self, generation: Generation) -> None:
        generation.timer = GenerationTimer(self.metrics)
        rid = generation.response.id
        # Registered before any worker is asked (compaction included), so that a cancel on another
        # replica reaches it; a stored response refuses to start when the store is down (it could
        # not be kept).
        await self.live.add(rid, generation.owner, generation.response.snapshot(), required=self._stores(generation))
        try:
            await self.compaction_phase(generation)
            await generation.open()
        except BaseException:
            await self.live.discard(rid)
            raise
        self.inflight[rid] = generation

    def _stores(self, generation: Generation) -> bool:
        return self.store is not None and self.store.enabled and bool(generation.body.get("store", True))

    async def finish_foreground(self, generation: Generation, own_input: list[dict]) -> ApiError | None:
        """Store the finished response and forget it as in flight. When the store could not
        keep it, the response is marked failed and the refusal returned for a door that has not
        answered yet (a streamed one ends with ``response.failed``)."""
        response = generation.response
        self.inflight.pop(response.id, None)
        await self.live.discard(response.id)
        refusal: ApiError | None = None
        try:
            await self._persist(response, generation.body, own_input, owner=generation.owner)
        except StoreUnavailable as error:
            refusal = error
            if response.status in ("completed", "incomplete"):
                response.fail("server_error", "The response could not be stored: the response store is unavailable.")
        if refusal is not None:
            await self.event_buffers.discard(response.id)  # the store is away: do not wait on it
        elif response.status in TERMINAL:
            await self.event_buffers.finish(response.id, terminal_event(response))
        return refusal

    def stream_recorder(self, generation: Generation) -> Callable[[dict], None] | None:
        """Where a stored foreground stream records its numbered events, so that streamed
        retrieval can follow it while it runs; None when it is not stored."""
        if not self._stores(generation):
            return None
        return self.event_buffers.open(generation.response.id, generation.owner).keep

    async def _persist(self, response: ResponseObject, body: dict, own_input: list[dict], *, job: Job | None = None, owner: Any = None) -> None:
        """Remember the reasoning, append the turn to its conversation, store the response (for a
        job: store its final object and end the job, in one step).

        Raises StoreUnavailable when the store is down; a job is ended anyway (failed, if its
        conversation could not take the turn), so it is never left running."""
        background = job is not None
        snapshot = response.snapshot()
        if snapshot.get("usage") is None:
            snapshot["usage"] = zero_usage()
        await self.reasoning_echo.remember(snapshot["output"], owner)
        if response.status in ("completed", "incomplete") and snapshot["output"]:
            try:
                await self._append_turn(body, own_input, snapshot["output"], owner)
            except StoreUnavailable:
                if not background:
                    raise
                response.fail("server_error", "The response could not be appended to its conversation: the conversation store is unavailable.")
                snapshot = dict(response.snapshot(), output=[])
        if self.store is None:
            return
        ephemeral = background and not body.get("store", True)
        if not body.get("store", True) and not ephemeral:
            return
        stored = StoredResponse(snapshot, body["input"], ephemeral=ephemeral, extra={"owner": owner})
        # An organization may fill its share of the store (store/lru.py), local mode all of it.
        budget, whose = (self.store.max_bytes, "the response store's byte budget") if owner is None else (int(OWNER_SHARE * self.store.max_bytes), "this organization's share of the response store")
        if background and self.store.size_of(stored) > budget:
            # Too large for the budget: keep a failed stub so that a poll still gets an answer.
            stub = dict(snapshot, status="failed", output=[], usage=zero_usage(), error={"code": "server_error", "message": f"The finished response is larger than {whose} ({budget} bytes)."})
            stored = StoredResponse(stub, [], ephemeral=ephemeral, extra={"owner": owner})
        kept = await self.jobs.finish(job, stored) if job is not None else await self.store.put(stored)
        if kept and not ephemeral and stored.response is snapshot:
            await self.index_items(owner, list(stored.input_items) + list(snapshot["output"]), ("response", snapshot["id"]))

    async def _append_turn(self, body: dict, own_input: list[dict], output: list[dict], owner: Any) -> None:
        conv = conversation_id(body.get("conversation"))
        if conv is None:
            return
        key = conversation_key(conv, owner)
        output = [_strip_status(i) for i in output]
        if output and output[0].get("type") == "compaction":
            # Auto-compaction rewrote the history: the transcript becomes the compacted one.
            added = await self.conversations.replace(key, body["input"] + output[1:], conversation_id=conv)
        else:
            added = await self.conversations.add_items(key, own_input + output, conversation_id=conv)
        await self.index_items(owner, added, ("conversation", key))

    async def index_items(self, owner: Any, items: list[dict], holder: tuple[str, str]) -> None:
        """Index stored items for ``item_reference``; best effort (the holder is stored already,
        an item left out is only unreferenceable by id)."""
        try:
            await self.items.add(owner, items, holder)
        except StoreUnavailable:
            log.warning("stored items not indexed: the store is unavailable", extra={"holder": holder[0]})

    # -- background ------------------------------------------------------------------------------
    async def start_background(self, generation: Generation, own_input: list[dict]) -> dict:
        response = generation.response
        response.data["status"] = "queued"
        reserved = approx_bytes(generation.body) + 4 * (generation.body.get("max_output_tokens") or 1024)
        job = Job(response, generation, generation.body["input"], own_input, reserved, extra={"owner": generation.owner})
        await self.jobs.admit(job)  # 429 past the deployment's job or byte limits (before 503)
        try:
            worker = self.pool.pick(generation.model, routing_key(generation.body, generation.options.session))
        except NoWorker:
            await self.jobs.withdraw(job)
            raise ApiError(503, f"No worker is serving model '{generation.model}' right now.", code="server_is_overloaded")
        if worker.overloaded():
            await self.jobs.withdraw(job)
            raise ApiError(503, "The generation queue is full; retry shortly.", code="server_is_overloaded")
        job.events = self.event_buffers.open(response.id, generation.owner)
        job.events.record({"type": "response.created", "response": job_view(response)})
        await job.events.flush()  # readable by streamed retrieval on any replica from now on
        job.task = asyncio.create_task(self._run_job(job), name=f"kiln-job-{response.id}")
        return job_view(response)

    async def _run_job(self, job: Job) -> None:
        response, generation, events = job.response, job.generation, job.events
        try:
            try:
                await self.compaction_phase(generation)
            except ApiError as error:
                # context_management runs inside the job: its failure fails the job.
                raise GenerationFailed(error.status, "invalid_prompt" if error.status == 400 else (error.code or "server_error"), error.message)
            await generation.open()
            if response.status == "queued":
                response.data["status"] = "in_progress"
                await self.jobs.update(job, job_view(response))
            events.record({"type": "response.in_progress", "response": job_view(response)})
            async for event in generation.events():
                if response.status == "queued":
                    response.data["status"] = "in_progress"
                events.record(event)
        except GenerationFailed as failure:
            response.fail(_JOB_CODES.get(failure.code, "server_error"), failure.message)
        except ApiError as error:
            response.fail("server_overloaded" if error.status == 503 else "server_error", error.message)
        except asyncio.CancelledError:
            generation.cancel()
            if job.extra.get("shutdown"):
                response.fail("server_error", "The gateway replica running this background response shut down before it finished.")
            else:
                response.cancel()
        except Exception as exc:  # a job must always end terminal
            log.exception("background job failed")
            response.fail("server_error", str(exc))
        finally:
            if response.status not in TERMINAL:
                response.cancel() if generation.cancelled else response.fail("server_error", "generation ended without a result")
            try:
                await self._persist(response, generation.body, job.own_input, job=job, owner=generation.owner)
            except StoreUnavailable:
                log.error("background response not stored: the store is unavailable", extra={"response_id": response.id})
            if job.extra.get("taken_over"):
                await self.event_buffers.discard(response.id)  # the replica that took it ended its stream
            else:
                await self.event_buffers.finish(response.id, terminal_event(response))

    async def _cancel_job(self, job: Job) -> None:
        """Cancel a job this replica runs and wait until its final object is stored."""
        job.generation.cancel()
        if job.task is not None:
            job.task.cancel()
            try:
                await job.task
            except (asyncio.CancelledError, Exception):
                pass

    async def _cancel_here(self, response_id: str) -> dict | None:
        """A cancel sent by another replica for a response this one runs: the job's or response's
        state after cancelling, or None when it does not run here (any more)."""
        job = self.jobs.active.get(response_id)
        if job is not None:
            await self._cancel_job(job)
            return {"id": response_id, "status": job.response.status}
        generation = self.inflight.get(response_id)
        if generation is not None:
            generation.cancel()
            generation.response.cancel()
            return generation.response.snapshot()
        return None

    # -- retrieve / cancel / delete --------------------------------------------------------------
    def _require_store(self) -> ResponseStore:
        if self.store is None:
            raise ApiError(404, "Responses are not stored on this gateway.", code="not_found")
        if not self.store.enabled:
            raise invalid("The response store is disabled on this server (--responses-store-max-entries 0).")
        return self.store

    async def _lookup(self, response_id: str, owner: Any) -> tuple[JobState | None, Generation | None, StoredResponse | None]:
        """What the id names, as far as ``owner`` may see it (another tenant's ids are unknown)."""
        store = self._require_store()
        generation = self.inflight.get(response_id)
        if generation is not None and generation.owner != owner:
            generation = None
        # The stored object first: a job's final object is stored as the job ends (in one step),
        # so a stored response is never also a running job, and the common read is one round trip.
        stored = await store.get(response_id)
        job = await self.jobs.get(response_id) if stored is None else None
        if job is not None and job.owner != owner:
            job = None
        if stored is not None and stored.owner != owner:
            stored = None
        return job, generation, stored

    async def _live_elsewhere(self, response_id: str, owner: Any) -> dict | None:
        """The opening snapshot of a foreground response another replica runs for ``owner``."""
        found = await self.live.get(response_id)
        if found is None or found[0] != owner:
            return None
        return found[1]

    async def get(self, response_id: str, owner: Any = None) -> dict:
        job, generation, stored = await self._lookup(response_id, owner)
        if job is not None:
            return job.view
        if generation is not None and generation.body.get("store", True):
            return generation.response.snapshot()
        if stored is not None:
            return stored.response
        live = await self._live_elsewhere(response_id, owner)
        if live is not None and live.get("store", True):
            return live  # in progress on another replica: no partial output, as a poll
        raise _not_found(response_id)

    async def event_stream(self, response_id: str, owner: Any = None) -> Any:
        """The recorded (and live) events of a response the owner may see; 404 when it has
        none: streamed retrieval covers background jobs and stored foreground streams."""
        job, generation, stored = await self._lookup(response_id, owner)
        if job is None and generation is None and stored is None:
            live = await self._live_elsewhere(response_id, owner)
            if live is None or not live.get("store", True):
                raise _not_found(response_id)
        if generation is not None and not generation.body.get("store", True):
            raise _not_found(response_id)
        reader = await self.event_buffers.reader(response_id)
        if reader is None:
            raise invalid(f"Response '{response_id}' has no events to stream: streamed retrieval covers background responses and streamed stored responses, while their events are kept.", param="stream")
        return reader

    async def input_items(self, response_id: str, owner: Any = None) -> list[dict]:
        job, _, stored = await self._lookup(response_id, owner)
        if job is not None:
            return job.input_items
        if stored is None:
            raise _not_found(response_id)
        return stored.input_items

    async def delete(self, response_id: str, owner: Any = None) -> dict:
        job, _, stored = await self._lookup(response_id, owner)
        if job is not None:
            raise invalid(f"Response '{response_id}' is still running (status: {job.view.get('status')}); cancel it first.")
        if stored is None or not await self._require_store().delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str, owner: Any = None) -> dict:
        store = self._require_store()
        job, generation, stored = await self._lookup(response_id, owner)
        if job is not None:
            running = self.jobs.active.get(response_id)
            if running is not None:
                await self._cancel_job(running)
            else:
                await self.jobs.cancel_elsewhere(response_id, job)  # through the replica running it
            stored = await store.get(response_id)
            return stored.response if stored is not None else dict(job.view, status="cancelled")
        if generation is not None:
            generation.cancel()
            generation.response.cancel()
            return generation.response.snapshot()
        if stored is None and await self._live_elsewhere(response_id, owner) is not None:
            cancelled = await self.live.cancel_elsewhere(response_id)
            if cancelled is not None:
                return cancelled
            stored = await store.get(response_id)  # it finished meanwhile
            if stored is not None and stored.owner != owner:
                stored = None
        if stored is None:
            raise _not_found(response_id)
        if stored.response.get("status") == "cancelled":
            return stored.response
        raise invalid(f"Response '{response_id}' has already finished (status: {stored.response.get('status')}); only in-flight responses can be cancelled.")


def _strip_status(item: dict) -> dict:
    return {k: v for k, v in item.items() if k != "status"}


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", code="not_found", param="response_id")
