"""Slots, and spreading items over the upstream replicas of one server.

`Slots` is a bounded number of concurrent calls with two counters, items waiting for a slot
and items holding one; counters change only inside `Slots.use()`, so no failure or
cancellation can leave them raised. Each upstream base URL is a `Replica`: its own slots
(`--max-in-flight`; the runner gives agents' replicas `--agent-concurrency`) and a refusal
mark. `Balancer.pick` sends an item to the replica with the fewest items waiting or holding a
slot there (least in-flight), rotating between equals, and avoids for `REFUSED_COOLDOWN`
seconds a replica that refused a connection. How long an item may wait for a slot is the
attempts' rule (`attempts.slot_wait`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Iterable

from nemo_gym_grpc.bridge.flows.limits import Limit

log = logging.getLogger(__name__)

# Seconds a replica that refused a connection is passed over while another one is available.
REFUSED_COOLDOWN = 5.0
# Bounded waits for a slot end on this grid (seconds of the event loop's clock), rounded down:
# the waits that end in one step share one timer (`Slots`).
EXPIRY_GRID = 0.01


class SlotTimeout(Exception):
    """`Slots.use(wait)` found no free slot within `wait` seconds; `queued`: seconds it
    waited."""

    def __init__(self, queued: float) -> None:
        super().__init__(f"no free slot within {queued:.3f} s")
        self.queued = queued


class Slots:
    """`size` slots for concurrent calls, and their load; callers wait in arrival order.

    A free slot costs one comparison; a wait, one future (and, when bounded, a place in the
    set of waits that end in the same EXPIRY_GRID step, one timer for them all); a slot given
    back goes straight to the oldest caller still waiting. (asyncio.Semaphore with
    asyncio.timeout cost 13.6% of the bridge's samples at capacity, where nearly every item
    queues: on Python 3.11 `Semaphore.locked` scans its waiters, and each bounded wait built a
    Timeout; a timer per wait, as next, still cost 6% at a zero-work upstream under the
    adaptive limit, and ~650 bytes per waiting item; docs/performance.md.)

    Attributes:
        size: the slots (`resize` changes it).
        waiting: items waiting for a slot.
        in_flight: items holding one.
    """

    __slots__ = ("_expiries", "_waiters", "in_flight", "size", "waiting")

    def __init__(self, size: int) -> None:
        self.size = size
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._expiries: dict[float, _Expiry] = {}  # by the loop time they end at
        self.waiting = 0
        self.in_flight = 0

    @property
    def load(self) -> int:
        """Items here and not finished: waiting plus in flight."""
        return self.waiting + self.in_flight

    def use(self, wait: float | None = None) -> _Slot:
        """`async with slots.use(wait) as queued:` holds one slot for the body; `queued` is the
        seconds spent waiting for it, at most `wait` (None: as long as it takes; a wait's end is
        rounded down to EXPIRY_GRID), else `SlotTimeout` is raised and the body does not run.
        The counters are restored however the body (or the wait) ends; a caller cancelled as a
        slot was handed to it passes the slot on."""
        return _Slot(self, wait)

    async def _acquire(self, wait: float | None) -> float:
        if self.in_flight < self.size and not self.waiting:
            self.in_flight += 1
            return 0.0
        queued_at = time.monotonic()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(future)
        self.waiting += 1
        expiry = None if wait is None else self._expiry(loop, wait)
        if expiry is not None:
            expiry.futures.add(future)
        try:
            handed = await future
        except asyncio.CancelledError:
            if future.cancelled():  # cancelled while waiting
                self.waiting -= 1
            elif future.result():  # handed a slot just as it was cancelled: pass it on
                self._release()
            raise
        finally:
            if expiry is not None:
                self._leave(expiry, future)
        if not handed:
            raise SlotTimeout(time.monotonic() - queued_at)
        return time.monotonic() - queued_at

    def _expiry(self, loop: asyncio.AbstractEventLoop, wait: float) -> _Expiry:
        """The shared end of a wait of `wait` seconds from now, rounded down to EXPIRY_GRID."""
        at = math.floor((loop.time() + max(wait, 0.0)) / EXPIRY_GRID) * EXPIRY_GRID
        expiry = self._expiries.get(at)
        if expiry is None:
            expiry = self._expiries[at] = _Expiry(at)
            expiry.timer = loop.call_at(at, self._expire, expiry)
        return expiry

    def _leave(self, expiry: _Expiry, future: asyncio.Future[bool]) -> None:
        """A wait of `expiry` ended (a slot, the timer, a cancellation): its timer goes with
        the last one."""
        futures = expiry.futures
        futures.discard(future)
        if not futures and self._expiries.get(expiry.at) is expiry:
            del self._expiries[expiry.at]
            expiry.timer.cancel()

    def _expire(self, expiry: _Expiry) -> None:
        """The waits of `expiry` ended unserved: each of them is answered False."""
        if self._expiries.get(expiry.at) is expiry:
            del self._expiries[expiry.at]
        for future in expiry.futures:
            if not future.done():
                self.waiting -= 1
                future.set_result(False)

    def _release(self) -> None:
        if self.in_flight > self.size:  # the size shrank: this slot goes
            self.in_flight -= 1
            return
        waiters = self._waiters
        while waiters:
            future = waiters.popleft()
            if not future.done():
                self.waiting -= 1
                future.set_result(True)  # the slot passes on: in_flight stays
                return
        self.in_flight -= 1

    def resize(self, size: int) -> None:
        """Make it `size` slots: callers waiting take the new ones at once; when it shrinks,
        calls in flight finish and their slots go."""
        self.size = size
        waiters = self._waiters
        while waiters and self.in_flight < size:
            future = waiters.popleft()
            if not future.done():
                self.waiting -= 1
                self.in_flight += 1
                future.set_result(True)


class _Expiry:
    """The waits for a slot that end at loop time `at`, and their one timer."""

    __slots__ = ("at", "futures", "timer")

    def __init__(self, at: float) -> None:
        self.at = at
        self.futures: set[asyncio.Future[bool]] = set()
        self.timer: asyncio.TimerHandle


class Replica(Slots):
    """One upstream base URL and its load.

    Args:
        url: base URL, e.g. "http://127.0.0.1:18001" (no trailing slash).
        max_in_flight: most concurrent calls to it (its slots; with `adaptive`, the ceiling
            of its `limits.Limit`).
        adaptive: its slots follow a `limits.Limit`.
        share: the limiters in front of it that share its queue (`limits.Limit`'s `share`).

    Attributes:
        refused_until: `time.monotonic()` until which it is passed over (0 = never refused).
        limit: its adaptive limit, None when its slots are fixed.
    """

    def __init__(
        self, url: str, max_in_flight: int, adaptive: bool = False, share: int = 1
    ) -> None:
        self.limit = Limit(max_in_flight, share) if adaptive else None
        super().__init__(self.limit.size if self.limit else max_in_flight)
        self._logged = self.size  # the limit last logged (a move by 2x is)
        self.url = url
        self.refused_until = 0.0

    def answered(self, seconds: float, load: int, filled: bool) -> None:
        """One call answered 200 in `seconds`, sent while `load` calls were in flight here,
        `filled` if they were at least half its slots: a sample for the adaptive limit (see
        `limits`)."""
        assert self.limit is not None
        size = self.limit.sample(seconds, load, time.monotonic(), filled)
        if size == self.size:
            return
        self.resize(size)
        found = self.limit.limit
        if not self._logged / 2 <= found <= self._logged * 2:
            log.info(
                "concurrency limit of %s: %d -> %d (no-load latency %.1f ms)",
                self.url,
                self._logged,
                found,
                self.limit.no_load * 1000,
            )
            self._logged = found

    def refused(self) -> None:
        """Record a refused connection: pass this replica over for REFUSED_COOLDOWN s."""
        self.refused_until = time.monotonic() + REFUSED_COOLDOWN


class _Slot:
    """The async context manager of `Slots.use` (a class, not `asynccontextmanager`: this
    runs once per upstream call, and the generator-based form costs about 4 us more)."""

    __slots__ = ("_owner", "_wait")

    def __init__(self, owner: Slots, wait: float | None) -> None:
        self._owner = owner
        self._wait = wait

    async def __aenter__(self) -> float:
        return await self._owner._acquire(self._wait)

    async def __aexit__(self, *exc_info: object) -> None:
        self._owner._release()


class Balancer:
    """The replicas of every upstream URL the bridge has called, and the choice among them.

    Args:
        max_in_flight: slots per replica (`--max-in-flight`; the ceiling when `adaptive`).
        adaptive: each replica's slots follow its `limits.Limit`.
        share: the limiters that share each replica's queue (`--sharing-bridges` times the
            bridge's workers; `limits.Limit`).
    """

    def __init__(self, max_in_flight: int, adaptive: bool = False, share: int = 1) -> None:
        self._max_in_flight = max_in_flight
        self._adaptive = adaptive
        self._share = share
        self._replicas: dict[str, Replica] = {}
        self._turn = 0

    def replica(self, url: str) -> Replica:
        """The Replica of base URL `url` (created on first use, kept for the process)."""
        found = self._replicas.get(url)
        if found is None:
            found = self._replicas[url] = Replica(
                url, self._max_in_flight, self._adaptive, self._share
            )
        return found

    def reshare(self, share: int) -> None:
        """Set the limiters that share each replica's queue (`share` above) to `share`, for
        the replicas called so far and those to come (`serve --sharing-bridges-file`)."""
        self._share = share
        for replica in self._replicas.values():
            if replica.limit is not None:
                replica.limit.share = share

    def replicas(self) -> list[Replica]:
        """Every replica called so far (for metrics)."""
        return list(self._replicas.values())

    @property
    def share(self) -> int | None:
        """The limiters each replica's limit shares its queue with (`share` above); None
        with fixed limits (for metrics)."""
        return self._share if self._adaptive else None

    def pick(self, urls: list[str], tried: Iterable[str] = ()) -> Replica:
        """The replica of `urls` (a non-empty list of base URLs) for the next call.

        Order of preference: not in `tried` (the item's earlier attempts), not refused within
        REFUSED_COOLDOWN, least load; equals take turns. When every replica was tried or
        refused, the least loaded of them is still returned.
        """
        count = len(urls)
        if count == 1:
            return self.replica(urls[0])
        now = time.monotonic()
        skip = set(tried)
        self._turn += 1

        def rank(index: int) -> tuple[bool, bool, int, int]:
            replica = self.replica(urls[index])
            return (
                replica.url in skip,
                replica.refused_until > now,
                replica.load,
                (index - self._turn) % count,
            )

        return self.replica(urls[min(range(count), key=rank)])
