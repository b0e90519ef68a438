"""While a worker loads, it says what it is doing every few seconds (--log-level info)."""

from __future__ import annotations

import logging
import time

from kiln.worker.loading.progress import LoadProgress


def test_a_slow_step_reports_progress_then_its_duration(caplog):
    progress = LoadProgress("llama-1b.gguf", every=0.05)
    with caplog.at_level(logging.INFO, logger="kiln.worker.load"):
        with progress.step("reading and converting the weights"):
            progress.advance(300_000_000, 600_000_000)
            time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records]
    ticks = [line for line in lines if " for " in line]
    assert ticks, lines
    assert "loading llama-1b.gguf: reading and converting the weights for" in ticks[0]
    assert "300 of 600 MB (50 %)" in ticks[0] and "MB resident" in ticks[0]
    assert "reading and converting the weights took" in lines[-1] and "since start" in lines[-1]
    assert caplog.records[-1].step == "reading and converting the weights"


def test_a_quick_step_logs_only_its_duration(caplog):
    progress = LoadProgress("m", every=10.0)
    with caplog.at_level(logging.INFO, logger="kiln.worker.load"):
        with progress.step("preparing the engine"):
            pass
    assert [r.getMessage().split(" took ")[0] for r in caplog.records] == ["loading m: preparing the engine"]
