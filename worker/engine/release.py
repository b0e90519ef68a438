"""Give memory the engine no longer uses back to the system when it goes idle.

Why: a turn's temporaries (a long prompt's attention scores, the decode batch's KV) are freed by
mlx when the turn ends, but freed is not returned. mlx keeps freed buffers in its own cache, and
below its cache limit it hands them to malloc, whose heap keeps them: glibc returns only the top
of its heaps and raises its mmap threshold after every large free, so a worker's resident set
followed its largest turn so far and never came down (issue 30, item 7: 149 turns on one socket
took a worker from 1.3 to 2.35 GB). Between turns nothing is in flight, so the engine thread
empties mlx's buffer cache and asks malloc to trim every arena (``malloc_trim``, glibc only;
elsewhere the buffer cache is still emptied). What stays resident is the weights and the prefix
cache, which is bounded by ``--cache-bytes``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import lru_cache
from typing import Callable

import mlx.core as mx

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return None
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def release_idle_memory() -> None:
    """Empty mlx's buffer cache and trim malloc's heaps; only saves memory, so never raises."""
    try:
        mx.clear_cache()
        trim = _malloc_trim()
        if trim is not None:
            trim(0)
    except Exception:
        log.exception("releasing idle memory failed")
