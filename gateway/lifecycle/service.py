"""The life of a response across requests, put together: create (prepare, then foreground or
background), and the parts each door and route reaches by name — ``references`` (item references
and sealed reasoning), ``jobs`` (background responses), ``retrieval`` (get, cancel, delete).

This class owns the state that spans requests: the stores (the Protocols of
``store/protocols.py``, built by ``store/backend.py``, so nothing here depends on whether they live
in this process or in Redis shared by several replicas) and the responses in flight here, which
``cancel`` can reach; what differs across replicas is only *where* a job or an in-flight response
runs, which ``jobs.get`` / ``live.get`` tell and ``cancel_elsewhere`` reaches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..doors.create_request import CreateRequest
from ..doors.options import NO_OPTIONS, DoorOptions
from ..doors.validation import check_for_model
from ..http.errors import ApiError, invalid
from ..http.metrics import GenerationTimer
from ..pool.worker_request import check_sampling
from ..pool.workers import WorkerPool
from ..settings import Settings
from ..store.backend import build_stores
from ..store.conversations import ConversationFull
from ..store.protocols import StoreUnavailable
from . import compaction
from .generation import Generation, count_tokens, terminal_event
from .history import TERMINAL, check_call_outputs, expand
from .jobs import BackgroundJobs
from .persistence import Persistence
from .references import References
from .response_object import ResponseObject, new_response_id
from .retrieval import Retrieval
from .sealing import Sealer


class ResponsesService:
    def __init__(self, settings: Settings, pool: WorkerPool) -> None:
        self.settings = settings
        self.pool = pool
        self.stores = build_stores(settings)
        self.inflight: dict[str, Generation] = {}  # foreground responses in flight here
        self.references = References(self.stores, Sealer(settings.secret_key, encrypt=settings.encrypt_reasoning))
        self.persistence = Persistence(self.stores, self.references)
        self.jobs = BackgroundJobs(settings, pool, self.stores, self.persistence)
        self.retrieval = Retrieval(self.stores, self.inflight, self.jobs)
        self.metrics: Any = None  # set by the app when /metrics is mounted

    async def open(self) -> None:
        """Start what the stores run beside requests (Redis: leases, sweeper, cancel listener)."""
        await self.stores.open(self.retrieval.cancel_here)

    async def close(self) -> None:
        """Shutting down: this replica's jobs end ``failed`` now, then the stores close."""
        await self.jobs.shutdown()
        await self.stores.close()

    async def stats(self) -> dict[str, Any]:
        """What /health shows of the stores."""
        stats: dict[str, Any] = {"backend": self.stores.mode}
        store = self.stores.responses
        try:
            stats["responses"] = await store.stats() if store is not None else None
        except StoreUnavailable:
            stats["responses"] = {"available": False}
        stats["background"] = await self.stores.jobs.stats()
        return stats

    # -- create ----------------------------------------------------------------------------------
    async def prepare(self, request: CreateRequest, owner: Any = None, *, history: list[dict[str, Any]] | None = None, options: DoorOptions = NO_OPTIONS) -> tuple[Generation, list[dict[str, Any]]]:
        """Resolve the model and history; everything that can refuse the request happens here.

        ``request``: client fields only (``validate_create``); ``options``: what the door decided.
        ``history``: what ``previous_response_id`` names, already resolved by the door (a
        WebSocket connection's own state); None resolves it from the stores. The generation holds
        the request completed: the served model, the history expanded, ``max_output_tokens``
        capped where the door asked for it."""
        model = self.pool.require(request.model)  # 404, or 503 while its worker restarts
        window = self.pool.context_window(model)
        cap = window if options.cap_to_window and window and (request.max_output_tokens or 0) > window else request.max_output_tokens
        request = dataclasses.replace(request, model=model, max_output_tokens=cap)
        check_for_model(request, window)
        check_sampling(request)
        if request.background:
            self.jobs.check_allowed()
        own_input = await self.references.own_input(request.input, owner)
        if history is None:
            history = await self._history(request, owner)
        request = request.with_input(await self.stores.reasoning_echo.restore(history + own_input, owner))
        if not request.input:
            raise invalid("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
        generation = Generation(
            self.pool,
            ResponseObject(new_response_id(), request, model, echo_background=self.settings.echo_background),
            request,
            model,
            options=options,
            owner=owner,
            wire_input=compaction.expand_items(request.input),
            compact_threshold=compaction.compaction_settings(request.context_management),
            first_event_timeout_s=self.settings.first_event_timeout_s,
            event_timeout_s=self.settings.event_timeout_s,
            item_hook=self.references.seal_reasoning if "reasoning.encrypted_content" in request.include else None,
        )
        check_call_outputs(generation.wire_input)
        return generation, own_input

    async def count_input_tokens(self, request: CreateRequest, owner: Any = None, options: DoorOptions = NO_OPTIONS) -> int:
        """The prompt's length in tokens, rendered as a create with the same request would be
        (history, item references, sealed reasoning, the reasoning echo, compaction items): the
        one counter behind ``/v1/responses/input_tokens`` and ``/v1/messages/count_tokens``."""
        model = self.pool.require(request.model)  # 404, or 503 while its worker restarts
        request = dataclasses.replace(request, model=model)
        history = await self._history(request, owner)
        own = self.references.unseal(await self.references.resolve(request.input, owner))
        items = compaction.expand_items(await self.stores.reasoning_echo.restore(history + own, owner))
        return await count_tokens(self.pool, request, items, model, self.settings.first_event_timeout_s, options)

    async def _history(self, request: CreateRequest, owner: Any) -> list[dict[str, Any]]:
        """What ``previous_response_id`` and ``conversation`` name, from the stores."""
        return await expand(request, store=self.stores.responses, jobs=self.stores.jobs, conversations=self.stores.conversations, store_mode=self.settings.store_mode, owner=owner)

    async def compact_endpoint(self, request: CreateRequest, keep_tokens: Any = None, owner: Any = None) -> dict[str, Any]:
        """``POST /v1/responses/compact`` (the route refused stream and history fields): nothing
        is stored; ``item_reference`` items are resolved as on create. ``keep_tokens``: the
        endpoint's own field, as the client sent it (None: the model's default)."""
        model = self.pool.require(request.model)  # 404, or 503 while its worker restarts
        window = self.pool.context_window(model) or 0
        keep = compaction.default_keep_tokens(window) if keep_tokens is None else keep_tokens
        if isinstance(keep, bool) or not isinstance(keep, int) or keep <= 0:
            raise invalid("Invalid 'keep_tokens': expected an integer above 0.", param="keep_tokens")
        max_out = request.max_output_tokens or compaction.DEFAULT_MAX_OUTPUT_TOKENS
        request = dataclasses.replace(request, model=model, input=await self.references.own_input(request.input, owner))
        result = await compaction.compact(self.pool, request, model, keep_tokens=keep, max_output_tokens=max_out, timeout_s=self.settings.first_event_timeout_s, owner=owner)
        return compaction.compact_resource(result, model)

    async def start_foreground(self, generation: Generation) -> None:
        generation.timer = GenerationTimer(self.metrics)
        rid = generation.response.id
        # Registered before any worker is asked (compaction included), so that a cancel on another
        # replica reaches it; a stored response refuses to start when the store is down (it could
        # not be kept).
        await self.stores.live.add(rid, generation.owner, generation.response.snapshot(), required=self.persistence.keeps(generation.request))
        try:
            await compaction.compaction_phase(self.pool, generation, self.settings.first_event_timeout_s)
            await generation.open()
        except BaseException:
            await self.stores.live.discard(rid)
            raise
        self.inflight[rid] = generation

    async def finish_foreground(self, generation: Generation, own_input: list[dict[str, Any]]) -> ApiError | None:
        """Store the finished response and forget it as in flight. When the store could not
        keep it, or its conversation could not take the turn, the response is marked failed and the
        refusal returned for a door that has not answered yet (a streamed one ends with
        ``response.failed``)."""
        response = generation.response
        self.inflight.pop(response.id, None)
        await self.stores.live.discard(response.id)
        refusal: ApiError | None = None
        try:
            await self.persistence.persist(response, generation.request, own_input, owner=generation.owner)
        except StoreUnavailable as error:
            refusal = error
            if response.status in ("completed", "incomplete"):
                response.fail("server_error", "The response could not be stored: the response store is unavailable.")
        except ConversationFull as error:
            refusal = error  # the response is marked failed already (persistence.py)
        if isinstance(refusal, StoreUnavailable):
            await self.stores.events.discard(response.id)  # the store is away: do not wait on it
        elif response.status in TERMINAL:
            await self.stores.events.finish(response.id, terminal_event(response))
        return refusal

    def stream_recorder(self, generation: Generation) -> Callable[[dict[str, Any]], None] | None:
        """Where a stored foreground stream records its numbered events, so that streamed
        retrieval can follow it while it runs; None when it is not stored."""
        if not self.persistence.keeps(generation.request):
            return None
        return self.stores.events.open(generation.response.id, generation.owner).keep
