"""Waiting for a condition in a test, with a bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll `condition` every 50 ms until it is truthy.

    Raises:
        AssertionError: naming `what`, when `timeout` seconds pass first.
    """
    for pause in _polls(condition, timeout, what, 0.05):
        time.sleep(pause)


async def until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """`wait_until` for a test on an event loop: polls every 10 ms, letting the loop run."""
    for pause in _polls(condition, timeout, what, 0.01):
        await asyncio.sleep(pause)


def _polls(
    condition: Callable[[], object], timeout: float, what: str, every: float
) -> Iterator[float]:
    """Yields `every` (the seconds to wait before the next poll) while `condition()` is falsy;
    raises AssertionError naming `what` once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        yield every
