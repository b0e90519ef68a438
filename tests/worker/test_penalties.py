"""Presence and frequency penalties in the sampler (issue 15, point 0): OpenAI's definitions,
applied to the tokens a request has generated."""

from __future__ import annotations

import mlx.core as mx

from kiln.worker.engine.sampling import PenalizedSampler, greedy, make_sampler
from kiln.worker.engine.types import SamplingParams


def _row(values: list[float]) -> mx.array:
    return mx.log(mx.softmax(mx.array([values]), axis=-1))


def test_frequency_penalty_grows_with_each_repeat():
    sampler = PenalizedSampler(greedy, presence=0.0, frequency=0.6)
    row = _row([0.0, 3.0, 2.0, 0.0])  # token 1 leads token 2 by 1.0
    picks = [int(sampler(row)[0]) for _ in range(4)]
    # 1 (0 repeats), 1 (-0.6 still leads), 2 (1 was penalized 1.2), then 1 again (-1.2 vs -0.6 -> 1.8 vs 1.4).
    assert picks == [1, 1, 2, 1]


def test_presence_penalty_is_flat():
    sampler = PenalizedSampler(greedy, presence=1.5, frequency=0.0)
    row = _row([0.0, 3.0, 2.0, 0.0])
    # 1, then 2 (1.5 vs 2.0), then 1 again: both present, a flat 1.5 off each (1.5 vs 0.5).
    assert [int(sampler(row)[0]) for _ in range(3)] == [1, 2, 1]


def test_negative_penalty_encourages_repeats():
    sampler = PenalizedSampler(greedy, presence=-2.0, frequency=0.0)
    row = _row([0.0, 2.0, 2.5, 0.0])
    assert [int(sampler(row)[0]) for _ in range(3)] == [2, 2, 2]


def test_no_penalty_keeps_the_plain_greedy_path():
    assert make_sampler(SamplingParams(temperature=0)) is greedy
    assert isinstance(make_sampler(SamplingParams(temperature=0, frequency_penalty=0.5)), PenalizedSampler)
