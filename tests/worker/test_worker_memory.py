"""Worker memory over a long session stays bounded (issue 30, item 7), in the worker's own
accounting: the prefix cache's byte total stays under --cache-bytes, mlx's buffer cache is
emptied whenever the engine goes idle (engine/release.py), and what mlx holds beyond the weights
between turns is the prefix cache and nothing else, however many turns ran.

On the bundled model: one conversation that grows by a turn's output and a new message every
turn, as an agent socket does, past the prefix cache's budget. The worker's RSS over such a
session is a measurement, in bench/worker_memory.py.
"""

from __future__ import annotations

import threading

import pytest

from kiln.worker.engine import EngineRequest, SamplingParams, Scheduler, Step
from tests.support import wait_until

BOUND = 12 << 20  # ~270 tokens of the bundled model's float32 KV: the conversation outgrows it
SLACK = 4 << 20  # small arrays a turn leaves behind (the sampler's key, the last logits)


@pytest.fixture
def scheduler(gguf_model):
    s = Scheduler(gguf_model.model, cache_bytes=BOUND, max_batch=2)
    s.start()
    assert s.wait_set_up(300)
    yield s
    s.stop()


def turn(s: Scheduler, prompt: list[int]) -> list[int]:
    """One request to its end; its output tokens."""
    steps: list[Step] = []
    done = threading.Event()

    def on_step(step: Step) -> None:
        steps.append(step)
        if step.finish_reason is not None:
            done.set()

    s.submit(EngineRequest(prompt=list(prompt), params=SamplingParams(temperature=0, max_tokens=12), stop_tokens=frozenset(), on_step=on_step))
    assert done.wait(120), "turn did not finish"
    assert steps[-1].finish_reason in ("stop", "length"), steps[-1]
    return [st.token for st in steps if st.token is not None]


def idle_figures(s: Scheduler) -> dict:
    """The engine's figures once it has gone idle and released what its turns freed."""
    assert wait_until(lambda: s.stats()["mlx_cache_bytes"] == 0, timeout=30), s.stats()
    return s.stats()


def test_long_conversation_keeps_memory_within_the_prefix_cache_bound(scheduler, gguf_model):
    words = gguf_model.tokenizer.encode("Read the next module and say what it does. " * 40)
    conversation = words[:40]
    turn(scheduler, conversation)  # first turn: kernels and the sampler's first arrays
    baseline = idle_figures(scheduler)
    base = baseline["mlx_active_bytes"] - baseline["cache_bytes"]
    for i in range(12):
        conversation += turn(scheduler, conversation) + words[40 + 30 * i: 70 + 30 * i]
        figures = idle_figures(scheduler)
        assert 0 < figures["cache_bytes"] <= BOUND
        # Everything mlx holds between turns is the weights (and the first turn's leftovers)
        # plus the prefix cache: nothing grows with the turns.
        assert figures["mlx_active_bytes"] - base <= figures["cache_bytes"] + SLACK, (i, figures, baseline)
    assert len(conversation) > 400  # the conversation outgrew the bound several times over
