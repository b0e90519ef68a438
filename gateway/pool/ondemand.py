"""On-demand models: started at their first request, stopped when idle, within a memory budget.

The config file (protocol/model_config.py) marks a model ``load = "on-demand"``. Its workers are
not started with the server; the first request for it asks the supervisor to start them
(``StartModel`` over supervisor_link.py) and waits for the first one to register, at most
``--load-timeout`` seconds: past that the client gets 503 with Retry-After and the load goes on,
so a retry finds it loaded. When the model has had no request in flight for ``idle_stop``
seconds, its workers are retired from routing and stopped (``StopModel``): the processes exit
and their memory goes back to the OS.

The gateway owns this policy because it sees every request; the supervisor only runs processes.
With a ``memory_budget``, starting a model whose ``memory`` would not fit beside the models in
use first stops the least recently used idle on-demand models (waiting until their processes are
gone), or answers 503 when stopping every idle one would still not make room. A model counts its
declared ``memory`` per worker, or, without one (an always-loaded model), what its workers report
as resident.

Every admission (``gateway/lifecycle/admission.py``, the WebSocket door) calls :meth:`ModelLoader.ensure`
before the request resolves its model, so every door loads the same way.

The models that start with the server (``load = "always"``, and under ``kiln serve --model`` the
one model of the command line, which kiln serve hands the gateway as a generated config) are
loading from the start: until a first worker of theirs registers, :meth:`ModelLoader.ensure`
answers 503 ``model_loading`` with Retry-After at once (no request waits for a first load, which
may take minutes), never 404. :meth:`ModelLoader.loading` is what ``/health``'s ``ready`` reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kiln.protocol.control import ControlMessage, ModelExited, ModelStopped, StartModel, StopModel
from kiln.protocol.model_config import ModelConfig, ServeConfig

from ..http.errors import ApiError
from ..lifecycle.tasks import stop_tasks
from .workers import WorkerPool

log = logging.getLogger("kiln.gateway.pool.ondemand")

# How long an eviction may take: the supervisor SIGKILLs a worker 10 s after SIGTERM.
EVICT_WAIT_S = 60.0
RETRY_AFTER_S = 5  # while a model loads, or while the memory it needs is held by busy models
IDLE_TICK_S = 1.0

ModelStatus = Literal["loaded", "loading", "stopping", "not_loaded"]


def loading_error(name: str) -> ApiError:
    """The 503 of a model that is loading: the client retries after ``RETRY_AFTER_S``."""
    return ApiError(503, f"The model '{name}' is still loading; retry shortly.", code="model_loading", headers={"Retry-After": str(RETRY_AFTER_S)})


class Launcher(Protocol):
    """Who starts and stops processes: the supervisor link, or a test's fake."""

    async def start(self, on_message: Callable[[ControlMessage], None]) -> None: ...

    async def stop(self) -> None: ...

    def send(self, message: ControlMessage) -> None: ...


class LoadFailed(Exception):
    """A model's workers exited before one of them registered."""


@dataclass
class _Model:
    config: ModelConfig
    last_used: float = 0.0  # 0: not used since it was (last) loaded
    waiting: int = 0  # requests waiting for it to load
    starting: asyncio.Task[None] | None = None
    stopping: asyncio.Future[None] | None = None  # resolved when ModelStopped arrives
    failure: asyncio.Future[None] | None = None  # set (failed) by ModelExited during a load
    error: str | None = None  # why the last load failed

    @property
    def loading(self) -> bool:
        return self.starting is not None and not self.starting.done()


class ModelLoader:
    def __init__(self, config: ServeConfig | None, pool: WorkerPool, launcher: Launcher | None, *, load_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pool = pool
        self.launcher = launcher
        self.load_timeout_s = load_timeout_s
        self.clock = clock
        self._models = {m.id: _Model(m) for m in (config.models if config else []) if m.on_demand}
        self._decide = asyncio.Lock()  # one start decision (and its evictions) at a time
        self._task: asyncio.Task[None] | None = None
        if config is not None:
            pool.expect(name for m in config.models for name in m.names)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.launcher is not None:
            await self.launcher.start(self.on_message)
            if self._models:
                self._task = asyncio.create_task(self._idle_loop(), name="kiln-ondemand-idle")

    async def stop(self) -> None:
        await stop_tasks([self._task, *(m.starting for m in self._models.values())])
        if self.launcher is not None:
            await self.launcher.stop()

    # -- what the routes ask -------------------------------------------------------------------
    def entry(self, name: str) -> ModelConfig | None:
        """The config entry ``name`` (an id or alias) names, or None."""
        return self.config.lookup(name) if self.config is not None else None

    def status(self, model: ModelConfig) -> ModelStatus:
        state = self._models.get(model.id)
        if state is not None and state.stopping is not None:
            return "stopping"
        if self.pool.serves(model.id):
            return "loaded"
        if (state is not None and state.loading) or self._first_load(model):
            return "loading"
        return "not_loaded"

    def _first_load(self, model: ModelConfig) -> bool:
        """An always-loaded model none of whose workers has registered since this gateway started."""
        return not model.on_demand and self.pool.last_registration(model.id) is None

    def loading(self) -> list[str]:
        """The always-loaded models still waiting for their first worker: the deployment is ready
        (every model it starts with can take a request) when there are none."""
        return [m.id for m in (self.config.models if self.config else []) if self._first_load(m)]

    def last_error(self, model: ModelConfig) -> str | None:
        state = self._models.get(model.id)
        return state.error if state is not None else None

    @property
    def can_load(self) -> bool:
        """Whether this gateway can start on-demand models (it runs under kiln serve)."""
        return bool(self._models) and self.launcher is not None

    async def ensure(self, name: Any) -> None:
        """Return once the model ``name`` names can take the request: at once unless it is an
        on-demand model without a worker; then start it and wait, at most ``load_timeout_s``.
        Raises ApiError 503 (with Retry-After) when it cannot be loaded in time or at all."""
        if not isinstance(name, str):
            return
        entry = self.entry(name)
        if entry is None:
            return  # not in the config: the pool answers as it always does (404 for a stranger)
        state = self._models.get(entry.id)
        if state is None:
            if self._first_load(entry):
                raise loading_error(name)
            return  # loaded, or its worker restarting: the pool answers (503 while none is up)
        state.last_used = self.clock()
        if state.stopping is None and self.pool.serves(state.config.id):
            return
        if self.launcher is None:
            raise ApiError(503, f"The model '{name}' is loaded on demand, and this gateway has no supervisor to start it: run it under `kiln serve --config`, or start its worker.",
                code="model_not_loaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        state.waiting += 1
        try:
            if state.starting is None or state.starting.done():
                state.starting = asyncio.create_task(self._load(state), name=f"kiln-load-{state.config.id}")
                # Its outcome reaches the requests waiting now; one nobody waits for any more is dropped.
                state.starting.add_done_callback(lambda t: t.cancelled() or t.exception())
            await asyncio.wait_for(asyncio.shield(state.starting), self.load_timeout_s)
        except asyncio.TimeoutError:
            raise loading_error(name) from None
        except LoadFailed as exc:
            raise ApiError(503, f"The model '{name}' could not be loaded: {exc}", code="model_load_failed", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        finally:
            state.waiting -= 1
            state.last_used = self.clock()

    # -- loading -------------------------------------------------------------------------------
    async def _load(self, state: _Model) -> None:
        assert self.launcher is not None
        model = state.config
        async with self._decide:
            if state.stopping is not None:  # stopped just before this request: let it finish
                await self._stopped(state)
            victims = self._plan(model)
            for victim in victims:
                log.info("stopping idle model to make room", extra={"model": victim.config.id, "for": model.id})
                self._stop(victim)
            for victim in victims:
                await self._stopped(victim)
            state.error = None
            state.failure = asyncio.get_running_loop().create_future()
            log.info("starting on-demand model", extra={"model": model.id})
            started = self.clock()
            self.launcher.send(StartModel(model.id))
        failure = state.failure
        arrival = asyncio.ensure_future(self.pool.wait_for_model(model.id))
        try:
            await asyncio.wait({arrival, failure}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            arrival.cancel()
            state.failure = None
        if arrival.done() and not arrival.cancelled():
            if failure.done():
                failure.exception()  # a worker registered: that wins over a sibling that exited
        else:
            state.error = str(failure.exception())
            self.launcher.send(StopModel(model.id))  # no restart loop for a model that cannot load
            raise LoadFailed(state.error)
        log.info("on-demand model loaded", extra={"model": model.id, "seconds": round(self.clock() - started, 2)})

    async def _stopped(self, state: _Model) -> None:
        """Wait until a model being stopped has exited (its memory is back)."""
        if state.stopping is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(state.stopping), EVICT_WAIT_S)
        except asyncio.TimeoutError:
            raise LoadFailed(f"the model '{state.config.id}' did not stop within {EVICT_WAIT_S:.0f} s to make room") from None

    def _plan(self, target: ModelConfig) -> list[_Model]:
        """The idle on-demand models to stop so that ``target`` fits the budget (least recently
        used first); raises 503 when even stopping all of them would not make room."""
        budget = self.config.memory_budget if self.config is not None else None
        if budget is None:
            return []
        assert self.config is not None and target.memory is not None  # load_config checks both
        used = sum(self._cost(m) for m in self.config.models if m.id != target.id and self._counts(m))
        free, need = budget - used, target.memory * target.workers
        victims: list[_Model] = []
        for state in sorted(self._idle(exclude=target.id), key=lambda s: s.last_used):
            if need <= free:
                break
            victims.append(state)
            free += self._cost(state.config)
        if need > free:
            raise ApiError(503, f"The model '{target.id}' needs {need} bytes and the memory budget has {max(free, 0)} left beside models that are busy; retry shortly.",
                code="memory_budget_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
        return victims

    def _counts(self, model: ModelConfig) -> bool:
        """Whether ``model`` holds (or is about to hold) memory now."""
        state = self._models.get(model.id)
        if state is None:
            return True  # always loaded
        return self.pool.serves(model.id) or state.loading or state.stopping is not None

    def _cost(self, model: ModelConfig) -> int:
        if model.memory is not None:
            declared: int = model.memory * model.workers
            return declared
        return sum(w.rss_bytes for w in self.pool.handles(model.id))

    def _idle(self, exclude: str | None = None) -> list[_Model]:
        """Loaded on-demand models with nothing in flight and nobody waiting for them."""
        return [
            s for s in self._models.values()
            if s.config.id != exclude and s.stopping is None and not s.loading and not s.waiting
            and self.pool.serves(s.config.id) and self.pool.inflight(s.config.id) == 0
        ]  # fmt: skip

    # -- stopping ------------------------------------------------------------------------------
    def _stop(self, state: _Model) -> None:
        assert self.launcher is not None
        self.pool.retire(state.config.id)
        state.stopping = asyncio.get_running_loop().create_future()
        state.last_used = 0.0
        self.launcher.send(StopModel(state.config.id))

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(IDLE_TICK_S)
            self.check_idle()

    def check_idle(self) -> None:
        """Stop each loaded on-demand model that has been idle for its ``idle_stop``."""
        now = self.clock()
        for state in self._models.values():
            if self.pool.serves(state.config.id) and (self.pool.inflight(state.config.id) or state.waiting):
                state.last_used = now
        for state in self._idle():
            if state.last_used == 0.0:
                state.last_used = now  # loaded without a request of ours (a gateway restart)
            elif now - state.last_used >= state.config.idle_stop_s:
                log.info("stopping idle model", extra={"model": state.config.id, "idle_s": round(now - state.last_used, 1)})
                self._stop(state)

    # -- what the supervisor reports -------------------------------------------------------------
    def on_message(self, message: ControlMessage) -> None:
        state = self._models.get(getattr(message, "model", ""))
        if state is None:
            return
        if isinstance(message, ModelStopped):
            self.pool.forget_retired(state.config.id)
            if state.stopping is not None and not state.stopping.done():
                state.stopping.set_result(None)
            state.stopping = None
            log.info("on-demand model stopped", extra={"model": state.config.id})
        elif isinstance(message, ModelExited) and state.failure is not None and not state.failure.done():
            how = f"signal {-message.code}" if message.code < 0 else f"status {message.code}"
            state.failure.set_exception(LoadFailed(f"its worker exited with {how} while loading (the server log says why)"))
