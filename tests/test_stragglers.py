"""`nemo_gym_grpc.shared.stragglers` on its own (fast tier): no rollout straggles until enough
of its agent's have finished; one that has run more than FACTOR times their median (and the
least seconds) does, per agent; the warning naming the longest one is rate-limited per agent.
The bridge's use (`Runner.check_stragglers`, the `nemo_gym_grpc_rollouts_straggling` gauge)
and the rollout worker's read the same class."""

from __future__ import annotations

import logging
import time

from nemo_gym_grpc.shared import stragglers

log = logging.getLogger("test_stragglers")


def test_nothing_straggles_before_enough_peers_finished() -> None:
    watch = stragglers.Stragglers(log, "test", min_seconds=0.0)
    for _ in range(stragglers.MIN_PEERS - 1):
        watch.finished("agent", 0.01)
    assert watch.threshold("agent") is None
    assert watch.check([("agent", "r1", time.monotonic() - 100.0)]) == {}
    watch.finished("agent", 0.01)
    assert watch.threshold("agent") == stragglers.FACTOR * 0.01


def test_stragglers_are_counted_per_agent_and_logged_once_a_while(caplog) -> None:
    watch = stragglers.Stragglers(log, "RunStream", min_seconds=1.0)
    for _ in range(stragglers.MIN_PEERS):
        watch.finished("slow_agent", 0.5)  # threshold: max(1.0, 4 x 0.5) = 2 s
        watch.finished("fast_agent", 0.1)  # threshold: the least, 1 s
    now = time.monotonic()
    running = [
        ("slow_agent", "r-1", now - 1.5),  # within its threshold
        ("slow_agent", "r-2", now - 30.0),
        ("slow_agent", "r-3", now - 90.0),
        ("fast_agent", "r-4", now - 1.5),
        ("other_agent", "r-5", now - 1000.0),  # no peers finished: never a straggler
    ]
    with caplog.at_level(logging.WARNING, logger="test_stragglers"):
        assert watch.check(running) == {"slow_agent": 2, "fast_agent": 1}
        assert watch.check(running) == {"slow_agent": 2, "fast_agent": 1}  # not logged again
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "2 rollouts of agent slow_agent straggle; the longest, r-3, has run 90 s" in lines[0]
    assert "agent fast_agent" in lines[1] and "r-4" in lines[1]
