"""The bytes of NeMo Gym reply bodies the bridge reads at once, bounded (`--max-replies-mb`).

Every upstream reply reserves its size before its body is read: its Content-Length, or the
largest reply (`--max-reply-mb`) when the size is not known ahead (chunked or close-delimited,
or compressed: it may inflate up to that). A reservation is all or nothing and taken in order
of arrival, so a reply holds bytes only while its body is being read, and one whose size does
not fit waits without holding any: no set of half-read replies can hold the budget and wait
for each other. While a reply waits, its connection is not read (the upstream's TCP window
fills, and it slows down; what one socket read brought with the reply's head is already in
memory); its item's deadline keeps running. The bytes are given back once
the whole body is read (or the call ends otherwise); parsing it follows at once in the same
task, before another reply is read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class Reservation:
    """`size` bytes of a `ReplyBudget`, held (`held`) or waiting in its queue.

    Attributes:
        size: bytes.
        held: True once the bytes are taken (until `release`).
    """

    __slots__ = ("size", "held", "_budget", "_on_held")

    def __init__(self, budget: ReplyBudget, size: int) -> None:
        self.size = size
        self.held = False
        self._budget = budget
        self._on_held: Callable[[], None] | None = None

    def when_held(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once the bytes are taken (at once when they are)."""
        if self.held:
            callback()
        else:
            self._on_held = callback

    def release(self) -> None:
        """Give the bytes back, or leave the queue; a second call does nothing."""
        self._on_held = None
        if self.held:
            self.held = False
            self._budget.give(self.size)
        elif self._budget is not None:
            self._budget.leave(self)
        self._budget = None  # type: ignore[assignment]

    def _take(self) -> None:
        self.held = True
        callback, self._on_held = self._on_held, None
        if callback is not None:
            callback()


class ReplyBudget:
    """Reply bytes held at once, at most `limit` (see the module docstring).

    Args:
        limit: bytes (> 0). A reservation larger than the whole limit is taken when nothing
            else is held (the bridge's checks keep `--max-reply-mb` within it).

    Attributes:
        limit: that limit.
        held: bytes held now.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._queue: deque[Reservation] = deque()

    @property
    def waiting(self) -> int:
        """Replies waiting for bytes now."""
        return len(self._queue)

    def reserve(self, size: int) -> Reservation:
        """A reservation of `size` bytes: held at once when they fit and no reply waits before
        it, else queued (`Reservation.when_held`)."""
        reservation = Reservation(self, size)
        if not self._queue and self._fits(size):
            self.held += size
            reservation.held = True
        else:
            self._queue.append(reservation)
        return reservation

    def give(self, size: int) -> None:
        """Count `size` bytes no longer held, and hand them to the waiting replies in order."""
        self.held -= size
        self._grant()

    def leave(self, reservation: Reservation) -> None:
        """Take a waiting `reservation` out of the queue (its call ended first)."""
        try:
            self._queue.remove(reservation)
        except ValueError:
            return
        self._grant()

    def _fits(self, size: int) -> bool:
        return self.held + size <= self.limit or self.held == 0

    def _grant(self) -> None:
        queue = self._queue
        while queue and self._fits(queue[0].size):
            reservation = queue.popleft()
            self.held += reservation.size
            reservation._take()
