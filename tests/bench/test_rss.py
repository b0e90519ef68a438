"""The bench reports the resident memory of the process that holds the model: found through the
server's session (Kiln's worker is a child of `kiln serve`), read from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from bench.servers import memory_mb, session_pids

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_servers_children_are_found_in_its_session_with_their_memory():
    # A stand-in for `kiln serve`: a parent in its own session with a `kiln.worker` child.
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', 'kiln.worker']); time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        for _ in range(100):
            pids = session_pids(parent.pid)
            if len(pids) == 2:
                break
            subprocess.run(["sleep", "0.05"])
        assert parent.pid in pids and len(pids) == 2
        child = next(p for p in pids if p != parent.pid)
        assert b"kiln.worker" in open(f"/proc/{child}/cmdline", "rb").read()
        rss, peak = memory_mb(child)
        assert rss is not None and peak is not None and 1 < rss <= peak
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the stand-in's own group: it and its child
        parent.wait()


def test_a_process_that_is_gone_has_no_memory():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert memory_mb(int(done.stdout)) == (None, None)
