"""A scripted engine and byte tokenizer, named as such, for protocol tests and overhead benches.

It plays the model's part with no weights: replies are fixed text, one byte a token, after an
optional delay per token. Faults are injected from the prompt text so that tests can provoke them
deterministically: ``[[crash]]`` kills the worker process mid-generation, ``[[error]]`` fails the
request on the scheduler thread, ``[[hang]]`` stops serving it after three tokens while the worker
keeps heartbeating (the gateway's deadlines must end it), ``[[slow-prefill]]`` spends
``SLOW_PREFILL_S`` on its prompt before the first token, reporting progress every ``PREFILL_CHUNK_S``
as the real scheduler does per chunk, and ``[[silent-prefill]]`` spends as long without a word.
Real-model tests cover the same code paths.
"""

from __future__ import annotations

import codecs
import logging
import os
import queue
import threading
import time
from typing import Any

from .engine.types import EngineRequest, QueueFull, Step

EOS = 256
# The scripted stand-in for a long prompt's prefill: its length and that of one chunk.
SLOW_PREFILL_S = 2.5
PREFILL_CHUNK_S = 0.1

log = logging.getLogger("kiln.worker.scripted")


class ByteTokenizer:
    """UTF-8 bytes as tokens; a plain "role: content" chat format."""

    chat_template = None
    eos_token_ids = frozenset({EOS})
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> ByteStreamDecoder:
        return ByteStreamDecoder()

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **_: Any) -> str:
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


class ByteStreamDecoder:
    """The byte tokenizer's incremental decoder: the same ``feed``/``flush`` contract as
    kiln.worker.loading.stream_decoder.StreamDecoder (complete characters only)."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: int | list[int]) -> str:
        ids = [ids] if isinstance(ids, int) else ids
        return self._utf8.decode(bytes(t for t in ids if t < 256))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class ScriptedScheduler:
    """Serves requests one token per ``delay_s`` each, ``capacity`` at a time."""

    def __init__(self, reply: str, *, delay_s: float = 0.0, capacity: int = 8, queue_depth: int = 64) -> None:
        self.reply = list(reply.encode("utf-8"))
        self.delay_s = delay_s
        self.capacity = capacity
        self.queue_depth = queue_depth
        self._waiting: queue.Queue[tuple[int, EngineRequest]] = queue.Queue()
        self._active: dict[int, tuple[EngineRequest, int]] = {}
        self._cancelled: set[int] = set()
        self._prefill_started: dict[int, float] = {}  # handle -> when its slow prefill began
        self._lock = threading.Lock()
        self._next = 0
        self._stop = threading.Event()
        self._wake = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="kiln-scripted", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def submit(self, request: EngineRequest) -> int:
        with self._lock:
            # Same admission rule as the real Scheduler: queue_depth beyond the free slots.
            free = max(0, self.capacity - len(self._active))
            if self._waiting.qsize() >= self.queue_depth + free:
                raise QueueFull()
            self._next += 1
            handle = self._next
        self._waiting.put((handle, request))
        self._wake.set()
        return handle

    def cancel(self, handle: int) -> None:
        with self._lock:
            self._cancelled.add(handle)
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        return {"active": len(self._active), "queued": self._waiting.qsize(), "cache_hits": 0, "cache_lookups": 0, "cached_tokens_total": 0, "cache_bytes": 0}

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:  # moved under the lock submit() counts under, never counted nowhere
                while len(self._active) < self.capacity and not self._waiting.empty():
                    handle, request = self._waiting.get()
                    self._active[handle] = (request, 0)
            if not self._active:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            if self.delay_s:
                time.sleep(self.delay_s)
            for handle, (request, produced) in list(self._active.items()):
                try:
                    self._advance(handle, request, produced)
                except Exception:  # a callback's bug ends its own request, as in the real scheduler
                    log.exception("on_step callback failed")
                    self._active.pop(handle, None)
                    try:
                        request.on_step(Step(None, None, None, "error", error="on_step failed"))
                    except Exception:
                        pass

    def _advance(self, handle: int, request: EngineRequest, produced: int) -> None:
        with self._lock:
            cancelled = handle in self._cancelled
            self._cancelled.discard(handle)
        if cancelled:
            del self._active[handle]
            self._prefill_started.pop(handle, None)
            request.on_step(Step(None, None, None, "cancelled"))
            return
        prompt_text = bytes(t for t in request.prompt if t < 256)
        if produced == 0 and self._prefilling(handle, request, prompt_text):
            return
        if b"[[crash]]" in prompt_text and produced >= 3:
            os._exit(17)
        if b"[[hang]]" in prompt_text and produced >= 3:
            return  # stays active and never advances: a request the worker silently stopped serving
        if b"[[error]]" in prompt_text and produced >= 3:
            del self._active[handle]
            request.on_step(Step(None, None, None, "error", error="scripted failure"))
            return
        if produced >= len(self.reply):
            del self._active[handle]
            request.on_step(Step(EOS, None, None, "stop"))
            return
        token = self.reply[produced]
        produced += 1
        finish = "length" if produced >= request.params.max_tokens else None
        if finish:
            del self._active[handle]
        else:
            self._active[handle] = (request, produced)
        request.on_step(Step(token, -0.5 if request.params.logprobs else None, None, finish))

    def _prefilling(self, handle: int, request: EngineRequest, prompt_text: bytes) -> bool:
        """One chunk of a scripted slow prefill (True while it lasts), blocking this thread as a
        real chunk does; progress is reported unless the prompt asks for a silent one."""
        silent = b"[[silent-prefill]]" in prompt_text
        if not silent and b"[[slow-prefill]]" not in prompt_text:
            return False
        started = self._prefill_started.setdefault(handle, time.monotonic())
        if time.monotonic() - started >= SLOW_PREFILL_S:
            del self._prefill_started[handle]
            return False
        time.sleep(PREFILL_CHUNK_S)
        if not silent and request.on_progress is not None:
            request.on_progress()
        return True
