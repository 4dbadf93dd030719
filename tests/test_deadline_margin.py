"""`attempts.time_left`: what an upstream call may take before the RPC deadline (the margin
kept back is 50 ms, or 2% of the time left when that is more)."""

from __future__ import annotations

import pytest

from nemo_gym_grpc.bridge.flows.attempts import time_left


@pytest.mark.parametrize(
    ("left", "allowed"),
    [
        (0.01, 0.01 - 0.05),  # already inside the margin: no time (<= 0)
        (1.0, 0.95),  # short calls keep the fixed 50 ms
        (2.5, 2.45),  # 2% of 2.5 s is exactly 50 ms
        (10.0, 9.8),  # longer ones keep 2% of what is left
        (600.0, 588.0),
    ],
)
def test_the_margin_is_50_ms_or_2_percent_of_the_time_left(left, allowed):
    assert time_left(100.0 + left, now=100.0) == pytest.approx(allowed)
