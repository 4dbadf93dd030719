"""Client-side load balancing: the reward functions reach several real bridges through one
multi-address (`ipv4:A,B`) or `dns:///` target with gRPC's round_robin policy.

Evidence per bridge: each bridge reaches the real NeMo Gym mcqa server through its own
FaultProxy (passing everything through), whose count of `/verify` POSTs is exactly the number
of items that bridge handled.
"""

from __future__ import annotations

import asyncio

import pytest

from nemo_gym_grpc.rewards import reward_nemo_gym_verify, reward_nemo_gym_verify_async
from nemo_gym_grpc.rewards.client import settings
from tests.support import example_rows
from tests.support.fault_proxy import FaultProxy


def mcqa_args(count: int) -> tuple[dict, list[float]]:
    """reward-function arguments for `count` mcqa rows (even ones right) and their rewards."""
    rows = [example_rows("mcqa")[i % 5] for i in range(count)]
    answers, expected = [], []
    for i, row in enumerate(rows):
        right = i % 2 == 0
        letter = (
            row["expected_answer"] if right else ("A" if row["expected_answer"] != "A" else "C")
        )
        answers.append(f"The answer is \\boxed{{{letter}}}")
        expected.append(float(right))
    columns = {"resources_server_ref": [{"name": "mcqa"}] * count, "verify_extra": rows}
    return {"completions": answers, **columns}, expected


@pytest.fixture
def two_bridges(nemo_gym, start_bridge, monkeypatch):
    """[(bridge, proxy), (bridge, proxy)]: two bridges, each to mcqa through its own proxy."""
    monkeypatch.delenv(settings.TARGET_ENV, raising=False)
    monkeypatch.setenv(settings.CONNECT_TIMEOUT_ENV, "20")
    with (
        FaultProxy(nemo_gym.server_urls["mcqa"]) as p1,
        FaultProxy(nemo_gym.server_urls["mcqa"]) as p2,
    ):
        pairs = [(start_bridge("--server", f"mcqa={p.url}"), p) for p in (p1, p2)]
        yield pairs


def test_round_robin_spreads_the_calls_over_both_bridges(two_bridges, monkeypatch):
    (b1, p1), (b2, p2) = two_bridges
    monkeypatch.setenv(settings.TARGET_ENV, f"ipv4:{b1.target},{b2.target}")
    args, expected = mcqa_args(4)
    for _ in range(6):
        assert reward_nemo_gym_verify(**args) == expected
    assert p1.total + p2.total == 24
    assert p1.total > 0 and p2.total > 0  # pick_first would send all 24 to the first
    assert asyncio.run(reward_nemo_gym_verify_async(**args)) == expected
    assert p1.total + p2.total == 28


def test_calls_keep_succeeding_through_the_other_bridge_when_one_stops(two_bridges, monkeypatch):
    (b1, p1), (b2, p2) = two_bridges
    monkeypatch.setenv(settings.TARGET_ENV, f"ipv4:{b1.target},{b2.target}")
    args, expected = mcqa_args(4)
    assert reward_nemo_gym_verify(**args) == expected
    assert b1.stop() == 0  # SIGTERM by PID: drained and exited
    before = (p1.total, p2.total)
    for _ in range(4):
        assert reward_nemo_gym_verify(**args) == expected
        assert asyncio.run(reward_nemo_gym_verify_async(**args)) == expected
    assert p1.total == before[0]
    assert p2.total == before[1] + 32


def test_a_dns_target_reaches_the_bridge(two_bridges, monkeypatch):
    (bridge, proxy), _ = two_bridges
    port = bridge.target.rsplit(":", 1)[1]
    monkeypatch.setenv(settings.TARGET_ENV, f"dns:///localhost:{port}")
    args, expected = mcqa_args(3)
    assert reward_nemo_gym_verify(**args) == expected
    assert asyncio.run(reward_nemo_gym_verify_async(**args)) == expected
    assert proxy.total == 6
