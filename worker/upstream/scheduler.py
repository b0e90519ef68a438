"""The upstream engine behind the scheduler interface the GenerationService drives.

``submit`` / ``cancel`` / ``stats`` / ``start`` / ``stop`` are those of engine/scheduler.py's
Scheduler (and scripted.py's), and each request's tokens come back through its ``on_step`` one
``Step`` at a time, so rendering, limits, output parsing, usage and the worker protocol are the
MLX worker's own code; only where the tokens are sampled differs.

One asyncio loop on its own thread runs every request as a task: at most ``capacity`` streams
to the engine at once (the engine's slots: llama-server ``--parallel``, vLLM ``--max-num-seqs``),
``queue_depth`` more waiting, the rest refused at once (503). Cancelling a request cancels its
task, which closes its stream, which aborts it in the engine. A health probe runs beside them:
while the engine does not answer it, new requests are refused (503, which the gateway reroutes
to another replica) and ``healthy`` is False, which stops the worker registering and
heartbeating, so the gateways drop it from their pool until the engine is back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..engine.types import EngineRequest, QueueFull, SamplingParams, Step
from ..service import ENGINE_UNAVAILABLE
from .client import UpstreamClient
from .constraint import EngineConstraint
from .requests import Kind, completion_call
from .responses import Chunk, UpstreamError, reader

log = logging.getLogger("kiln.worker.upstream")

HEALTH_INTERVAL_S = 1.0
# Consecutive failed probes before an engine that was up counts as down: one slow answer from an
# engine busy with a full batch must not take the model out of every gateway's pool.
DOWN_AFTER_FAILURES = 2
STOP_TIMEOUT_S = 5.0


class EngineUnavailable(QueueFull):
    """The engine does not answer its health probe: refused like a full queue (503)."""


class UpstreamScheduler:
    def __init__(self, base_url: str, kind: Kind, encode: Callable[[str], list[int]], *, capacity: int, queue_depth: int, model: str | None = None, api_key: str | None = None) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.kind = kind
        self.encode = encode
        self.capacity = capacity
        self.queue_depth = queue_depth
        self.model = model
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="kiln-upstream", daemon=True)
        self._lock = threading.Lock()
        self._tasks: dict[int, concurrent.futures.Future[None]] = {}
        self._abandoned: set[int] = set()  # cancelled because the engine went down, not by the gateway
        self._active = 0
        self._next = 0
        self._healthy = threading.Event()
        self._checked = threading.Event()  # the first probe has answered
        self._cached_total = 0
        self._client: UpstreamClient | None = None
        self._slots: asyncio.Semaphore | None = None

    # -- the scheduler interface -------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._healthy.is_set()

    def wait_checked(self, timeout: float) -> bool:
        """Wait for the first health probe's answer; whether the engine is up."""
        self._checked.wait(timeout)
        return self.healthy

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._setup(), self._loop).result()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(STOP_TIMEOUT_S)
        except Exception:
            log.warning("the upstream engine's connections did not close in time")
        self._loop.call_soon_threadsafe(self._loop.stop)

    def submit(self, request: EngineRequest) -> int:
        if not self.healthy:
            raise EngineUnavailable(ENGINE_UNAVAILABLE)
        with self._lock:
            if len(self._tasks) >= self.capacity + self.queue_depth:
                raise QueueFull()
            self._next += 1
            handle = self._next
            self._tasks[handle] = asyncio.run_coroutine_threadsafe(self._serve(handle, request), self._loop)
        return handle

    def cancel(self, handle: int) -> None:
        with self._lock:
            task = self._tasks.get(handle)
        if task is not None:
            task.cancel()  # thread-safe: the loop cancels the coroutine, closing its stream

    def stats(self) -> dict[str, Any]:
        with self._lock:
            active, held = self._active, len(self._tasks)
        return {"active": active, "queued": held - active, "cache_hits": 0, "cache_lookups": 0, "cached_tokens_total": self._cached_total, "cache_bytes": 0, "engine": self.kind,
            "engine_healthy": self.healthy}

    # -- the loop ----------------------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _setup(self) -> None:
        self._client = UpstreamClient(self.base_url, connections=self.capacity, api_key=self.api_key)
        self._slots = asyncio.Semaphore(self.capacity)
        self._monitor = asyncio.ensure_future(self._watch())

    async def _shutdown(self) -> None:
        self._monitor.cancel()
        for task in asyncio.all_tasks(self._loop) - {asyncio.current_task()}:
            task.cancel()
        if self._client is not None:
            await self._client.close()

    async def _watch(self) -> None:
        assert self._client is not None
        failures = 0
        while True:
            answered = await self._client.healthy()
            failures = 0 if answered else failures + 1
            up = answered or (self.healthy and failures < DOWN_AFTER_FAILURES)
            if up != self.healthy or not self._checked.is_set():
                (log.info if up else log.warning)("the upstream engine is %s", "up" if up else "not answering", extra={"engine": self.kind, "url": self.base_url})
            if not up and self.healthy:
                self._abandon_all()
            (self._healthy.set if up else self._healthy.clear)()
            self._checked.set()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    def _abandon_all(self) -> None:
        """The engine stopped answering: its streams would only wait for the gateway's deadlines
        (a frozen engine accepts connections and says nothing), so they end now, with 503."""
        with self._lock:
            tasks = dict(self._tasks)
            self._abandoned.update(tasks)
        for task in tasks.values():
            task.cancel()

    async def _serve(self, handle: int, request: EngineRequest) -> None:
        assert self._client is not None and self._slots is not None
        try:
            async with self._slots:
                with self._lock:
                    self._active += 1
                try:
                    await self._generate(request)
                finally:
                    with self._lock:
                        self._active -= 1
        except asyncio.CancelledError:
            with self._lock:
                abandoned = handle in self._abandoned
            step = Step(None, None, None, "error", error="the engine stopped answering", unavailable=True) if abandoned else Step(None, None, None, "cancelled")
            _deliver(request, step)
        except UpstreamError as exc:
            unreachable = exc.status == 0  # no connection, or one broken off: the engine is gone
            if unreachable:
                self._healthy.clear()  # refuse new requests until the probe sees it back
            log.warning("upstream request failed: %s", exc, extra={"engine": self.kind})
            _deliver(request, Step(None, None, None, "error", error=str(exc), unavailable=unreachable or exc.status == 503))
        except Exception as exc:  # a bug of ours ends this request, never the loop
            log.exception("upstream request failed")
            _deliver(request, Step(None, None, None, "error", error=type(exc).__name__))
        finally:
            with self._lock:
                self._tasks.pop(handle, None)
                self._abandoned.discard(handle)

    async def _generate(self, request: EngineRequest) -> None:
        assert self._client is not None
        # Upstream's constraint_factory puts its EngineConstraint (not a callable) among them.
        processors: list[object] = list(request.logits_processors)
        constraint = next((c for c in processors if isinstance(c, EngineConstraint)), None)
        prefix = self.encode(constraint.prefix) if constraint is not None and constraint.prefix else []
        suffix = self.encode(constraint.suffix) if constraint is not None and constraint.suffix else []
        params = request.params
        if prefix or suffix:  # the tags are output too: the engine gets what is left of the cap
            params = SamplingParams(**{**vars(params), "max_tokens": max(1, params.max_tokens - len(prefix) - len(suffix))})
        call = completion_call(self.kind, request.prompt + prefix, params, sorted(request.stop_tokens), constraint, self.model)
        for token in prefix:
            request.on_step(Step(token, None, None, None))
        read = reader(self.kind, self.encode)
        finish: str | None = None
        last = Chunk()
        async for event in self._client.stream(call):
            chunk = read(event)
            for i, token in enumerate(chunk.tokens):
                if finish is not None:
                    break  # after a stop token: the engine's own end, nothing to show
                if token in request.stop_tokens:
                    finish = "stop"
                    break
                logprob, top = chunk.logprobs[i] if chunk.logprobs is not None else (None, None)
                request.on_step(Step(token, logprob if params.logprobs else None, top if params.top_logprobs else None, None))
            finish = finish or chunk.finish
            if chunk.finish is not None or chunk.prompt_tokens is not None:
                last = chunk
        if finish is None:
            raise UpstreamError("the engine ended the stream before the request finished")
        if last.cached_tokens:
            request.cached_tokens = int(last.cached_tokens)
            self._cached_total += request.cached_tokens
        if finish == "length":
            request.on_step(Step(None, None, None, "length"))
            return
        for token in suffix:
            request.on_step(Step(token, None, None, None))
        request.on_step(Step(min(request.stop_tokens, default=0), None, None, "stop"))


def _deliver(request: EngineRequest, step: Step) -> None:
    try:
        request.on_step(step)
    except Exception:
        log.exception("on_step callback failed")
