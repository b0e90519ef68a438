"""The worker's resident memory, reported in every heartbeat.

The gateway counts it against the host's ``memory_budget`` for models that declare no ``memory``
of their own (docs/models.md). Linux reads the current resident set from /proc; elsewhere (macOS)
the peak resident set is the figure the standard library has, which never undercounts.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Iterable

import numpy as np

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """Bytes of this process resident in memory now (the peak where "now" is not available)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def resident_part(arrays: Iterable[np.ndarray]) -> int | None:
    """Bytes of these arrays' pages that are in this process's resident set now, or None where
    that cannot be asked (no /proc/self/pagemap: not Linux). For memory-mapped arrays (a GGUF's
    blocks, kept panels) the kernel maps their pages in as they are read and may drop them
    again, so such a matrix may take less of the resident set than its size, or none of it.
    (mincore would say which pages are in the page cache, mapped here or not: not the same.)"""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            pages: set[int] = set()  # page numbers, so that a page two matrices share counts once
            for a in arrays:
                if a.nbytes == 0:
                    continue
                address = a.__array_interface__["data"][0]
                first = address // _PAGE
                count = (address + a.nbytes - 1) // _PAGE - first + 1
                f.seek(first * 8)
                entries = np.frombuffer(f.read(count * 8), dtype="<u8")
                pages.update((first + np.flatnonzero(entries >> np.uint64(63))).tolist())
    except (OSError, ValueError):
        return None
    return len(pages) * _PAGE
