"""The soak's RSS and fd checks (tests/support/soak_report.py) on recorded shapes of a bridge
life: lives of 60 s soaks that failed the old first-third checks without a leak, and leaks."""

from __future__ import annotations

from typing import Any

from tests.support.soak_report import _lives

MB = 2**20


def _series(
    rss_mb: list[float], start: float = 0.0, fds: list[int] | None = None
) -> list[dict[str, Any]]:
    """One sample a second of one bridge process (pid 1) with the given RSS in MB (and open
    fds, 100 each when not given)."""
    fds = fds or [100] * len(rss_mb)
    return [
        {"pid": 1, "t": start + k, "rss": int(v * MB), "fds": n}
        for k, (v, n) in enumerate(zip(rss_mb, fds, strict=True))
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


def test_fds_compared_with_their_peak_before_the_last_third() -> None:
    # the adaptive limits' pool: few connections in the first third, more after a killed
    # server came back, fewer at the end (as 8bf3178's CI run: 79 at first, 245 later)
    fds = [20] * 8 + [79] * 8 + [245] * 8 + [213] * 8
    (life,) = _lives(_series([80.0] * 32, fds=fds), [0.0], warmup=8)
    assert life["fds"] == [245, 213] and life["fd_growth"] < 0
    leak = [20] * 8 + [79 + 10 * k for k in range(24)]
    (leaking,) = _lives(_series([80.0] * 32, fds=leak), [0.0], warmup=8)
    assert leaking["fd_growth"] > 16
