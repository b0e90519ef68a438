"""The worker's resident memory, reported in every heartbeat.

The gateway counts it against the host's ``memory_budget`` for models that declare no ``memory``
of their own (docs/models.md). Linux reads the current resident set from /proc; elsewhere (macOS)
the peak resident set is the figure the standard library has, which never undercounts.
"""

from __future__ import annotations

import os
import resource
import sys

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """Bytes of this process resident in memory now (the peak where "now" is not available)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
