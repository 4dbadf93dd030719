"""Waiting for a condition in a test, with a bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll `condition` every 50 ms until it is truthy.

    Raises:
        AssertionError: naming `what`, when `timeout` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


async def until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """`wait_until` for a test on an event loop: polls every 10 ms, letting the loop run.

    Raises:
        AssertionError: naming `what`, when `timeout` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)
