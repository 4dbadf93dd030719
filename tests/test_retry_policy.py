"""`RetryPolicy.backoff`: exponential backoff with full jitter (pure, no network)."""

from __future__ import annotations

import random

import pytest

from nemo_gym_grpc.bridge.flows.attempts import RetryPolicy


@pytest.mark.parametrize(
    ("attempt", "cap"), [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.6), (6, 2.0), (30, 2.0)]
)
def test_backoff_is_uniform_up_to_the_doubling_capped_bound(attempt, cap):
    policy = RetryPolicy(attempts=3, budget=60.0, initial_backoff=0.1, max_backoff=2.0)
    random.seed(attempt)
    waits = [policy.backoff(attempt) for _ in range(2000)]
    assert all(0.0 <= wait <= cap for wait in waits)
    assert max(waits) > 0.95 * cap and min(waits) < 0.05 * cap  # full jitter: all of [0, cap]
    assert abs(sum(waits) / len(waits) - cap / 2) < 0.05 * cap


def test_defaults_are_tenths_of_a_second_doubling_to_two_seconds():
    policy = RetryPolicy(attempts=3, budget=60.0)
    assert (policy.initial_backoff, policy.max_backoff) == (0.1, 2.0)
