"""A bounded set of slots with a first-come first-served queue, for the bridge's per-upstream
and per-agent concurrency limits.

Why not `asyncio.Semaphore` with `asyncio.timeout`: at capacity nearly every item queues for
an upstream slot, and there the semaphore costs O(waiters) per call on Python 3.11
(`Semaphore.locked` scans its waiters, `acquire` removes its future from the middle of a
deque) and each bounded wait one `Timeout` object, its rescheduling and a task lookup
(measured: 13.6% of the bridge's samples at capacity, docs/performance.md). Here a free slot
is one comparison, a wait one future, and its bound one timer handle; a slot that frees goes
straight to the oldest waiter still waiting.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Slots:
    """At most `size` holders at once; the others wait in arrival order.

    Args:
        size: the number of slots (>= 1).

    Attributes:
        held: slots held now.
        waiting: callers waiting for one now.
    """

    __slots__ = ("_size", "_waiters", "held", "waiting")

    def __init__(self, size: int) -> None:
        self._size = size
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self.held = 0
        self.waiting = 0

    def take(self) -> bool:
        """Take a free slot now if one is free and nobody waits: True when taken."""
        if self.held < self._size and not self.waiting:
            self.held += 1
            return True
        return False

    async def acquire(self, wait: float | None = None) -> bool:
        """Hold a slot: True once held (release it with `release`), False when `wait`
        seconds passed first (None: wait as long as it takes). A caller cancelled while
        waiting holds nothing, even when a slot was handed to it just then."""
        if self.take():
            return True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(future)
        self.waiting += 1
        timer = None if wait is None else loop.call_later(max(wait, 0.0), self._expire, future)
        try:
            return await future
        except asyncio.CancelledError:
            if future.cancelled():  # cancelled while waiting
                self.waiting -= 1
            elif future.result():  # handed a slot just as it was cancelled: pass it on
                self.release()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self, future: asyncio.Future[bool]) -> None:
        if not future.done():
            self.waiting -= 1
            future.set_result(False)

    def release(self) -> None:
        """Give back a held slot: the oldest waiter still waiting gets it."""
        waiters = self._waiters
        while waiters:
            future = waiters.popleft()
            if not future.done():
                self.waiting -= 1
                future.set_result(True)  # the slot passes on: `held` stays
                return
        self.held -= 1
