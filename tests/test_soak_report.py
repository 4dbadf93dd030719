"""The soak's RSS check (tests/support/soak_report.py) on recorded shapes of a bridge life: the
second life of a 60 s soak that failed the old first-third check without a leak, and a leak."""

from __future__ import annotations

from typing import Any

from tests.support.soak_report import _lives

MB = 2**20


def _series(rss_mb: list[float], start: float = 0.0) -> list[dict[str, Any]]:
    """One sample a second of one bridge process (pid 1) with the given RSS in MB."""
    return [
        {"pid": 1, "t": start + k, "rss": int(v * MB), "fds": 100} for k, v in enumerate(rss_mb)
    ]


def test_a_high_water_mark_reached_mid_life_is_not_growth() -> None:
    # as measured on a30e3ec's CI: 80 MB in the first third after warm-up, 97.7 MB after the
    # killed server came back, 93 MB at the end (the old check said +16%)
    rss = [60.0] * 8 + [78, 79, 80, 80, 80, 80, 85, 92, 97.7, 96, 95, 94, 93, 93, 93, 93, 93, 93]
    (life,) = _lives(_series(rss), [0.0], warmup=8)
    assert life["measured"]
    assert life["rss_mb"] == [97.7, 93.0]
    assert life["rss_growth"] < 0


def test_a_leak_sets_new_highs_to_the_end() -> None:
    rss = [60.0] * 8 + [80 + 1.5 * k for k in range(24)]
    (life,) = _lives(_series(rss), [0.0], warmup=8)
    assert life["rss_growth"] > 0.10
