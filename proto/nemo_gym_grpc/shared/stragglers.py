"""Rollouts running far longer than their peers, found and reported the same way by the bridge
(`RunStream`) and by the trainer side's rollout worker.

A rollout straggles when it has run more than FACTOR times the median duration of the last
WINDOW rollouts of its agent that finished, and at least MIN_SECONDS; until MIN_PEERS of them
have finished, none does. Nothing is cut for it: a long agent step is legitimate, and each
rollout keeps its own deadline. What is reported: the number straggling now per agent (a
gauge), and one log line per agent at most every LOG_EVERY seconds naming its longest-running
straggler. Both sides check every CHECK_EVERY seconds.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Iterable

FACTOR = 4.0
MIN_SECONDS = 60.0
MIN_PEERS = 8
WINDOW = 64
LOG_EVERY = 60.0
CHECK_EVERY = 10.0  # seconds between two checks of the running rollouts, on both sides


class Stragglers:
    """The durations of finished rollouts per agent, and the check of running ones against them.

    Args:
        log: where the rate-limited lines go (WARNING).
        where: who reports, for the log line ("RunStream", "the rollout worker").
        min_seconds: the least running time that may count as straggling (MIN_SECONDS).
    """

    def __init__(self, log: logging.Logger, where: str, min_seconds: float = MIN_SECONDS) -> None:
        self._log = log
        self._where = where
        self._min_seconds = min_seconds
        self._durations: dict[str, deque[float]] = {}
        self._logged: dict[str, float] = {}

    def finished(self, agent: str, seconds: float) -> None:
        """Record the duration of a rollout of `agent` that finished (seconds)."""
        durations = self._durations.get(agent)
        if durations is None:
            durations = self._durations[agent] = deque(maxlen=WINDOW)
        durations.append(seconds)

    def threshold(self, agent: str) -> float | None:
        """Seconds past which a rollout of `agent` straggles, or None while fewer than
        MIN_PEERS of its rollouts have finished."""
        durations = self._durations.get(agent)
        if durations is None or len(durations) < MIN_PEERS:
            return None
        return max(self._min_seconds, FACTOR * statistics.median(durations))

    def check(self, running: Iterable[tuple[str, str, float]]) -> dict[str, int]:
        """Count the stragglers among `running` rollouts, (agent, name for the log, started at
        `time.monotonic()` seconds), per agent; log the longest-running one of each agent
        (rate-limited). Agents with none are left out."""
        now = time.monotonic()
        counts: dict[str, int] = {}
        longest: dict[str, tuple[float, str]] = {}
        for agent, name, started in running:
            limit = self.threshold(agent)
            seconds = now - started
            if limit is None or seconds <= limit:
                continue
            counts[agent] = counts.get(agent, 0) + 1
            if seconds > longest.get(agent, (0.0, ""))[0]:
                longest[agent] = (seconds, name)
        for agent, (seconds, name) in longest.items():
            if now - self._logged.get(agent, -LOG_EVERY) < LOG_EVERY:
                continue
            self._logged[agent] = now
            median = statistics.median(self._durations[agent])
            self._log.warning(
                "%s: %d rollouts of agent %s straggle; the longest, %s, has run %.0f s (the "
                "median of its last %d finished: %.1f s); it keeps its own deadline",
                self._where, counts[agent], agent, name, seconds,
                len(self._durations[agent]), median,
            )  # fmt: skip
        return counts
