"""Continuous batching: the one thread that owns the model.

Each turn of the loop is one token boundary:
  1. take new submissions and cancellations (under the lock, briefly);
  2. one decode step for every request in the DecodeBatch, delivering a token to each;
     finished and cancelled rows leave, their KV going to the prefix cache;
  3. about prefill_chunk tokens of prompt work for admitted requests, FIFO (a long prompt
     chunk by chunk, several short ones in one batched pass; see prefill.py); a request
     whose prompt is done joins the DecodeBatch and decodes from the next turn on.
Requests are admitted (prefill + decode together) up to max_batch; the rest wait in a
queue of at most queue_depth. A failing forward pass fails the requests it involved
(the whole decode batch, or one prefill; a failed batched prefill is retried one
request at a time to find the culprit) and the loop carries on.

Failures stay with the request at fault. Every request taken off the queue is at all times
in exactly one place: the prefill queue, the decode batch, or finished (its on_step has had
its terminal step). Nothing leaves the prefill queue before everything that can fail for it
alone (prefix lookup, its sampler, its prompt pass) has succeeded, so a failure either fails
that request or puts the others back for another try. An on_step that raises ends its own
request (with a terminal "error" step) and nothing else.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from ..native.build import claim_team
from . import cpu_exp
from .batch import DecodeBatch, Delivery, Row, extract_row
from .cache import PrefixCache
from .kv_int8 import KVCacheType
from .layout import choose_weight_layout, on_cpu, use_input_major_weights
from .native_decode import PREFILL_TOKENS, NativeDecoder
from .native_verdict import CheckSource, build_checked
from .prefill import GROUP_PREFILL, Prefill, prefill_together
from .release import release_idle_memory
from .sampling import make_sampler
from .speculative import DecodeStats, Speculation
from .types import EngineRequest, QueueFull, Step

log = logging.getLogger(__name__)

_CLEAR_EVERY = 256  # decode steps between releases of mlx's buffer cache


def _supports_prefix_cache(model: nn.Module) -> bool:
    """Prefix reuse trims caches to a common prefix: plain KVCache layers only."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def kv_cache_refusal(kv_cache: KVCacheType, max_batch: int) -> str | None:
    """Why this batch size cannot have this cache, or None: the 8-bit cache's native pass takes
    a whole decode batch in one call (kv_int8.py), at most PREFILL_TOKENS rows."""
    if kv_cache == "int8" and max_batch > PREFILL_TOKENS:
        return f"--kv-cache int8 decodes at most {PREFILL_TOKENS} requests together (--max-batch {max_batch})"
    return None


class Scheduler:
    """Runs every request for one model on a single thread, batched token by token."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch: int = 8,
        queue_depth: int = 64,
        prefill_chunk: int = 512,
        cache_bytes: int = 512 << 20,
        input_major_weights: bool | None = None,
        speculation: Speculation | None = None,
        check_source: CheckSource | None = None,
        kv_cache: KVCacheType = "float32",
    ) -> None:
        """input_major_weights: store dense weights transposed for faster CPU matmuls
        (see layout.py); None = on the CPU, whichever layout measures faster. Modifies
        model in place. speculation: prompt-lookup drafting (speculative.py); None = its
        defaults. check_source: the loaded model's file and settings, under which the native
        pass's build check is remembered (native_verdict.py); None = checked at every start.
        kv_cache: "int8" keeps the KV cache in 8 bits where the native pass runs every step
        (kv_int8.py); that pass then takes a whole decode batch in one step, so at most
        PREFILL_TOKENS rows."""
        refused = kv_cache_refusal(kv_cache, max_batch)
        if refused:
            raise ValueError(refused)
        self._kv_cache: KVCacheType = kv_cache
        if input_major_weights is None:
            if on_cpu():
                choose_weight_layout(model)
        elif input_major_weights:
            use_input_major_weights(model)
        cpu_exp.install(model)  # on the CPU only: mlx's exp is slow there (cpu_exp.py says how slow)
        self._model = model
        self.max_batch = max(1, max_batch)
        self.queue_depth = queue_depth
        self.prefill_chunk = max(1, prefill_chunk)
        self._prefix = (
            PrefixCache(cache_bytes) if cache_bytes > 0 and _supports_prefix_cache(model) else None
        )
        self._cv = threading.Condition()
        self._waiting: deque[tuple[int, EngineRequest]] = deque()
        self._cancels: set[int] = set()
        self._handles = itertools.count(1)
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Owned by the scheduler thread.
        self._prefills: deque[Prefill] = deque()
        # Built on the engine thread (see _run), which then is the only one running the native
        # kernels: libgomp throttles its thread pools once a second thread has used them.
        self._native: NativeDecoder | None = None
        self._set_up = threading.Event()  # the engine thread has built (or given up on) the native pass
        self._check_source = check_source
        self.speculation = speculation or Speculation()
        self._decode_stats = DecodeStats()
        self._batch = self._new_batch()

    # ---- caller side (any thread) -------------------------------------------------

    def start(self) -> None:
        """Spawn the model-owning thread."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    def wait_set_up(self, timeout: float | None = None) -> bool:
        """Wait until the engine thread's set-up (the native decode pass: its build and its check
        against mlx, tens of seconds on a busy machine) is done, so that a request is served at
        once: the worker registers only then, and ``kiln serve`` says "ready" only then."""
        return self._set_up.wait(timeout)

    @property
    def kv_int8(self) -> bool:
        """Whether the KV cache is kept in 8 bits (asked for, and the native pass took it on);
        known once set up."""
        return self._native is not None and self._native.kv_int8

    def submit(self, req: EngineRequest) -> int:
        """Queue a request; its steps arrive through req.on_step. Returns its handle."""
        if not req.prompt:
            raise ValueError("empty prompt")
        req.params.validate()
        with self._cv:
            if self._stopping:
                raise RuntimeError("scheduler stopped")
            # Requests not yet moved into a free batch slot are not queued in the user's
            # sense: the limit is queue_depth beyond the slots still free, as the gateway counts.
            free = max(0, self.max_batch - len(self._batch) - len(self._prefills))
            if len(self._waiting) >= self.queue_depth + free:
                raise QueueFull(f"{len(self._waiting)} requests already waiting")
            handle = next(self._handles)
            self._waiting.append((handle, req))
            self._cv.notify()
        return handle

    def cancel(self, handle: int) -> None:
        """End a request at the next token boundary with finish_reason "cancelled"."""
        with self._cv:
            self._cancels.add(handle)
            self._cv.notify()

    def stats(self) -> dict[str, Any]:
        prefix = self._prefix
        return {
            "active": len(self._batch) + len(self._prefills),
            "queued": len(self._waiting),
            "cache_hits": prefix.hits if prefix else 0,
            "cache_lookups": prefix.lookups if prefix else 0,
            "cached_tokens_total": prefix.tokens_served if prefix else 0,
            "cache_bytes": prefix.nbytes if prefix else 0,
            "mlx_active_bytes": mx.get_active_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(),
            "mlx_peak_bytes": mx.get_peak_memory(),
            **self._decode_stats.as_dict(),
        }

    def stop(self) -> None:
        """Stop the thread; requests still in flight end with "cancelled"."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
        else:
            self._shutdown()

    # ---- scheduler thread ---------------------------------------------------------

    def _new_batch(self) -> DecodeBatch:
        return DecodeBatch(self._model, self._native, self.speculation, self._decode_stats)

    def _idle(self) -> bool:
        return not (self._waiting or self._cancels or self._prefills or len(self._batch))

    def _run(self) -> None:
        claim_team()  # before the build check's passes: only this thread opens native teams
        try:
            self._native = self._batch.native = build_checked(self._model, self._check_source, kv=self._kv_cache)
        finally:
            self._set_up.set()
        worked = False  # a turn ran since memory was last released
        try:
            while True:
                if worked and self._idle():
                    # Between turns nothing is in flight: return the turns' freed memory to the
                    # system (release.py), off the lock so that submit() never waits for it.
                    release_idle_memory()
                    worked = False
                with self._cv:
                    while not self._stopping and self._idle():
                        self._cv.wait()
                    if self._stopping:
                        break
                    cancels, self._cancels = self._cancels, set()
                    dropped = [(h, r) for h, r in self._waiting if h in cancels]
                    if dropped:
                        self._waiting = deque((h, r) for h, r in self._waiting if h not in cancels)
                    room = self.max_batch - len(self._batch) - len(self._prefills)
                    # Into _prefills under the lock: a request between the two lists would be
                    # counted by neither, and submit() would admit one more than batch + queue.
                    for _ in range(min(room, len(self._waiting))):
                        handle, req = self._waiting.popleft()
                        self._prefills.append(Prefill(handle, req, self._chunk()))
                for _, req in dropped:
                    self._finish(req, "cancelled")
                worked = True
                try:
                    self._turn(cancels)
                except Exception as e:  # a bug of ours: fail what is in flight, keep serving
                    log.exception("scheduler turn failed")
                    self._fail_in_flight(f"engine error: {e!r}")
        finally:
            self._shutdown()

    def _turn(self, cancels: set[int]) -> None:
        """One token boundary: cancellations, a decode step, then prompt work."""
        if cancels:
            self._cancel_running(cancels)
        if len(self._batch):
            self._decode()
        if self._prefills:
            self._prefill()

    def _fail_in_flight(self, error: str) -> None:
        prefills, self._prefills = list(self._prefills), deque()
        rows, self._batch = self._batch.rows, self._new_batch()
        mx.clear_cache()
        for req in [p.req for p in prefills] + [r.req for r in rows]:
            self._finish(req, "error", error)

    def _emit(self, req: EngineRequest, step: Step) -> bool:
        """Deliver one step; False when the callback raised (the caller then ends the request)."""
        try:
            req.on_step(step)
            return True
        except Exception:  # a caller's bug must not take the engine down
            log.exception("on_step callback failed")
            return False

    def _finish(self, req: EngineRequest, reason: str, error: str | None = None) -> None:
        self._emit(req, Step(None, None, None, reason, error))

    def _cancel_running(self, handles: set[int]) -> None:
        for p in [p for p in self._prefills if p.handle in handles]:
            self._prefills.remove(p)
            self._finish(p.req, "cancelled")
        drop = {i for i, r in enumerate(self._batch.rows) if r.handle in handles}
        if drop:
            rows = [self._batch.rows[i] for i in sorted(drop)]
            self._retire(drop)
            for row in rows:
                self._finish(row.req, "cancelled")

    def _retire(self, drop: set[int]) -> None:
        """Remove rows from the batch, keeping their KV in the prefix cache."""
        if self._prefix is not None:
            for i in sorted(drop):
                row = self._batch.rows[i]
                if row.started:
                    self._remember(row.tokens, partial(self._batch.extract, i), row.req.cache_scope)
        self._batch.remove(drop)

    def _remember(self, tokens: list[int], kv: Callable[[], list[KVCache]], scope: str | None) -> None:
        """Store KV in the prefix cache; it only saves work, so a failure here fails nobody."""
        try:
            assert self._prefix is not None  # the callers check
            self._prefix.insert(tokens, kv(), scope)
        except Exception:
            log.exception("prefix cache insert failed")

    def _decode(self) -> None:
        try:
            deliveries = self._batch.step()
        except Exception as e:
            log.exception("decode step failed")
            rows, self._batch = self._batch.rows, self._new_batch()
            mx.clear_cache()
            for row in rows:
                self._finish(row.req, "error", f"model step failed: {e!r}")
            return
        if self._batch.steps % _CLEAR_EVERY == 0:
            mx.clear_cache()
        # Last steps go out after their rows have left, so stats() never counts them.
        last: list[tuple[EngineRequest, Step]] = []
        done: set[int] = set()
        index = {id(r): i for i, r in enumerate(self._batch.rows)}
        for d in deliveries:
            if index[id(d.row)] in done:  # a row may get two tokens in one step; it ended at the first
                continue
            step = self._step_for(d)
            if step.finish_reason is None:
                if not self._emit(d.row.req, step):  # its callback broke: end it alone
                    last.append((d.row.req, Step(None, None, None, "error", "on_step failed")))
                    done.add(index[id(d.row)])
            else:
                last.append((d.row.req, step))
                done.add(index[id(d.row)])
        for i, row in enumerate(self._batch.rows):
            if row.error is not None and i not in done:
                last.append((row.req, Step(None, None, None, "error", row.error)))
                done.add(i)
        if done:
            self._retire(done)
        for req, step in last:
            self._emit(req, step)

    @staticmethod
    def _step_for(d: Delivery) -> Step:
        """The Step for one delivered token, deciding whether it ends the request."""
        row, params = d.row, d.row.req.params
        row.generated += 1
        reason = None
        if d.token in row.req.stop_tokens:
            reason = "stop"
        elif row.generated >= params.max_tokens:
            reason = "length"
        want_lp = params.logprobs or params.top_logprobs > 0
        top = d.top if params.top_logprobs else None
        return Step(d.token, d.logprob if want_lp else None, top, reason)

    def _chunk(self) -> int:
        """A long prompt's chunk: prefill_chunk tokens, at most what the native pass takes where
        it takes long prompts (their chunks then go through it, prefill.py)."""
        rows = self._native.prefill_rows if self._native is not None else 0
        return min(self.prefill_chunk, rows) if rows else self.prefill_chunk

    def _prefill(self) -> None:
        """About prefill_chunk tokens of prompt work, first come first served. A turn ends
        when a prompt is done, so its first token does not wait for the prompts queued
        behind it (the time to first token of requests arriving together is staggered
        rather than all equal to the last one's)."""
        spent = 0
        while self._prefills:
            head = self._prefills[0]
            if not self._begin(head):
                continue
            if head.short:
                group = self._short_group()
                cost = len(group) * max(p.remaining for p in group)
                if spent and spent + cost > self.prefill_chunk:
                    return
                try:
                    cache = prefill_together(self._model, group, self._native)
                except Exception as e:
                    mx.clear_cache()
                    if len(group) > 1:  # find the culprit: each stays queued and retries alone
                        log.warning("batched prefill failed (%r); retrying one by one", e)
                        for p in group:
                            p.solo = True
                    else:
                        self._fail_prefill(head, e)
                    continue
                spent += cost
                for p in group:
                    self._prefills.remove(p)
                self._join(group, cache, own_cache=False)
                return  # a decode step gives the joined rows their first token now
            if spent and spent + head.next_chunk() > self.prefill_chunk:
                return
            try:
                spent += head.run_chunk(self._model, self._native)
                finished = head.batch_cache() if head.remaining == 0 else None
            except Exception as e:
                mx.clear_cache()
                self._fail_prefill(head, e)
                continue
            if finished is not None:
                self._prefills.remove(head)
                self._join([head], finished, own_cache=head.native_cache is None)
                return
            mx.clear_cache()  # between chunks of a long prompt
            self._progress(head.req)

    def _progress(self, req: EngineRequest) -> None:
        """Tell the request's owner a chunk of its prompt is done; its bug never stops the loop."""
        if req.on_progress is None:
            return
        try:
            req.on_progress()
        except Exception:
            log.exception("on_progress callback failed")

    def _begin(self, p: Prefill) -> bool:
        """Set up one queued prefill (prefix lookup, its sampler) once; a failure fails it alone."""
        if p.begun:
            return True
        try:
            p.begin(self._model, self._prefix)
            p.sampler = make_sampler(p.req.params)
            return True
        except Exception as e:
            self._fail_prefill(p, e)
            return False

    def _fail_prefill(self, p: Prefill, e: Exception) -> None:
        log.error("prefill failed", exc_info=e)
        self._prefills.remove(p)
        self._finish(p.req, "error", f"prefill failed: {e!r}")

    def _short_group(self) -> list[Prefill]:
        """The run of short prefills at the head of the queue that fits one pass."""
        group: list[Prefill] = []
        for p in list(self._prefills):
            if not self._begin(p):
                continue  # failed and left the queue
            if not p.short or (p.solo and group):
                break
            width = max([q.remaining for q in group] + [p.remaining])
            if group and (len(group) + 1) * width > min(self.prefill_chunk, GROUP_PREFILL):
                break
            group.append(p)
            if p.solo:
                break
        return group

    def _join(self, group: list[Prefill], cache: list[BatchKVCache], own_cache: bool) -> None:
        """Move prefilled requests (their rows of cache, in order) into the decode batch.

        own_cache: each request's own .cache holds its whole prefill (chunked path);
        otherwise its KV is copied out of cache for the prefix cache.
        """
        rows = []
        for i, p in enumerate(group):
            prompt = p.req.prompt
            if self._prefix is not None and p.pos > p.cached:
                self._remember(prompt[:-1], p.begun_cache if own_cache else partial(extract_row, cache, i), p.req.cache_scope)
            assert p.sampler is not None  # made by _begin, before any prefill
            rows.append(Row(p.handle, p.req, p.sampler, tokens=list(prompt[:-1])))
        try:
            self._batch.add(rows, cache, [p.req.prompt[-1] for p in group])
        except Exception as e:
            log.exception("joining the batch failed")
            for p in group:
                self._finish(p.req, "error", f"batch join failed: {e!r}")

    def _shutdown(self) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
        for _, req in waiting:
            self._finish(req, "cancelled")
        for p in self._prefills:
            self._finish(p.req, "cancelled")
        self._prefills.clear()
        for row in self._batch.rows:
            self._finish(row.req, "cancelled")
        self._batch = self._new_batch()
        if self._prefix is not None:
            self._prefix.clear()
        # mlx wants a thread's streams destroyed by that thread before it ends; otherwise
        # the process aborts at exit ("terminate called without an active exception").
        if threading.current_thread() is self._thread:
            mx.synchronize()
            mx.clear_streams()
