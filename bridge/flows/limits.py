"""An adaptive concurrency limit per upstream replica (`--adaptive-concurrency`): each NeMo Gym
server gets as many calls at once as it serves without queueing them, between 1 and
`--max-in-flight`, found from the latency of its calls.

The rule is TCP Vegas's, as Netflix's concurrency-limits library (`VegasLimit`) applies it to
requests. With `no_load` the latency of a call that meets no queue and `rtt` a call's latency,
about `limit x (1 - no_load / rtt)` calls were queued at the server; the limit grows by
6 log10(limit) while that queue is at most log10(limit), by log10(limit) while it is under
3 log10(limit), shrinks by log10(limit) while it is over 6 log10(limit), and stays between.
A CPU-bound server (one uvicorn process: past its knee a call's latency is the calls ahead of
it times the work of one) settles a few calls above its knee; a server whose latency does not
grow with load (a judge, a sandbox) grows to the ceiling, by 6 log10(limit) per call.

Why Vegas, of the three the issue names: Netflix's Gradient2 compares a short to a long
average latency; it reacts to a sudden change but, as the long average follows the short one,
keeps growing on a server whose latency rises with its load. Vegas's estimate stops at the
knee, given the no-load latency, which is what needs care:

- a call sent while no other call was in flight on its replica (LOW_LOAD) met no queue; the
  no-load latency is the least of the last NO_LOAD_SAMPLES such calls (or of any faster call),
  so a server that speeds up lowers it at once;
- a limit held down by a queue estimate (more than log10(limit) calls queued) with no such call
  for CALIBRATE_AFTER seconds is re-measured as Envoy's adaptive concurrency filter does: the
  replica's slots drop to LOW_LOAD until CALIBRATION_SAMPLES calls met no queue, and the
  no-load latency is theirs. That is what follows a server that slowed down (a latency step
  looks like a queue to Vegas). Unlike Envoy's, it runs only while the limit is held by the
  queue estimate, never on a server whose latency does not grow with load, whose flow it
  would stall, and it costs a CPU-bound server a few calls every CALIBRATE_AFTER seconds.
"""

from __future__ import annotations

import math
from collections import deque

# A call sent with at most this many calls in flight on its replica (itself) met no queue.
LOW_LOAD = 1
# The no-load latency is the least of the last this many such calls.
NO_LOAD_SAMPLES = 8
# The limit of a replica not yet measured.
INITIAL_LIMIT = 20
# Seconds a limit held by its queue estimate goes without a no-load call before it is
# re-measured, and the no-load calls a re-measurement takes.
CALIBRATE_AFTER = 3.0
CALIBRATION_SAMPLES = 3


class Limit:
    """The adaptive concurrency limit of one replica (see the module docstring).

    Args:
        ceiling: the most it may grow to (`--max-in-flight`).

    Attributes:
        size: the slots now, calls: `limit`, or LOW_LOAD while re-measuring.
        no_load: the no-load latency now, seconds (inf before the first sample).
    """

    __slots__ = ("_calibrating", "_ceiling", "_last_low", "_limit", "_low", "no_load", "size")

    def __init__(self, ceiling: int) -> None:
        self._ceiling = ceiling
        self._limit = float(min(INITIAL_LIMIT, ceiling))
        self._low: deque[float] = deque(maxlen=NO_LOAD_SAMPLES)
        self._last_low = 0.0
        self._calibrating = False
        self.no_load = math.inf
        self.size = int(self._limit)

    @property
    def limit(self) -> int:
        """The limit found, calls (1..ceiling)."""
        return int(self._limit)

    def sample(self, rtt: float, load: int, now: float) -> int:
        """Take one call's latency `rtt` (seconds, answered 200), sent while `load` calls were
        in flight on the replica (itself included), at `now` (`time.monotonic()`). Returns
        the new `size`."""
        if self._calibrating:
            return self._calibrate(rtt, load, now)
        if load <= LOW_LOAD or rtt < self.no_load:
            self._low.append(rtt)
            self.no_load = min(self._low)
            self._last_low = now
        limit = self._limit
        if load * 2 < limit or rtt <= 0.0:
            return self.size
        step = math.log10(limit) if limit > 10.0 else 1.0
        queued = limit * (1.0 - self.no_load / rtt)
        if queued > step and now - self._last_low > CALIBRATE_AFTER:
            self._calibrating = True
            self._low.clear()
            self.size = min(LOW_LOAD, self.size)
            return self.size
        if queued <= step:
            limit += 6.0 * step
        elif queued < 3.0 * step:
            limit += step
        elif queued > 6.0 * step:
            limit -= step
        else:
            return self.size
        self._limit = limit = min(max(limit, 1.0), float(self._ceiling))
        self.size = int(limit)
        return self.size

    def _calibrate(self, rtt: float, load: int, now: float) -> int:
        """A sample while re-measuring: only calls that met no queue count; after
        CALIBRATION_SAMPLES of them the no-load latency is theirs and the limit is back."""
        if load <= LOW_LOAD:
            self._low.append(rtt)
        if len(self._low) >= CALIBRATION_SAMPLES:
            self.no_load = min(self._low)
            self._last_low = now
            self._calibrating = False
            self.size = int(self._limit)
        return self.size
