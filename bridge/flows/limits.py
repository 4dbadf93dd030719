"""An adaptive concurrency limit per upstream replica (on by default; `--fixed-concurrency`
turns it off): each NeMo Gym server gets as many calls at once as keep a small standing queue
at it, between 1 and `--max-in-flight`, found from the latency of its calls.

The rule is TCP Vegas's, as Netflix's concurrency-limits library (`VegasLimit`) applies it to
requests. With `no_load` the latency of a call that meets no queue and `rtt` a call's latency,
about `queued = load x (1 - no_load / rtt)` calls waited at the server for a call sent with
`load` calls in flight. The limit holds while that queue is between QUEUE_LOW and QUEUE_HIGH
(or Vegas's 3 and 6 log10(limit), if larger), grows by log10(limit) under it and shrinks by as
much over it (not below where that queue would be QUEUE_LOW: a window's answers all meet its
queue, and thousands of them would each take a step), with these additions:

- no queue (under half of QUEUE_LOW, or a latency under TOLERANCE times the no-load one) at
  QUEUE_LOW or more calls means the server is not what holds the calls back: each such answer
  adds GROWTH - 1 calls to the limit, if the calls were at least half the limit when it was
  sent. This is TCP slow start (one segment per acknowledgement), faster: a window of such
  answers multiplies the limit GROWTH times in one round trip, so a server whose latency does
  not grow with load, a judge or a sandbox, reaches a ceiling of 16,384 in four round trips
  from its first answers; and it grows no window the calls do not fill (RFC 7661). The growth
  follows the evidence: the first answers of a burst at a CPU-bound server met a short queue
  (the calls behind them are the queue), and only they grow it. Multiplying the limit on such
  answers sent it thousands of calls and new connections at once: at every answer, as it did
  first, one round trip's answers took it from 20 to thousands; once per round trip, as it
  did next, a new bridge's first burst still went 20 -> 181 -> 1,448 (measured on real mcqa,
  its limit then dropping to 30; now at most 92 calls in flight). The tolerance is
  Gradient2's: with thousands of calls in flight a few per cent of latency noise reads as a
  queue of dozens, and a 500 ms server answering in 510 ms is not queueing;
- a queue over twice the high mark with a latency over twice the no-load one means the limit
  is far past the knee (a server that slowed down, a limit that grew past the demand): it drops
  at once to where that queue would be QUEUE_LOW, `load x no_load / rtt + QUEUE_LOW`, as
  Gradient2 does with its gradient, instead of one step per call.

Why a standing queue of QUEUE_LOW..QUEUE_HIGH and not Vegas's 3..6 calls: a single-process
uvicorn server (most NeMo Gym resources servers) spends the least CPU per request when a dozen
or two wait (each event-loop turn then serves several); measured on real mcqa
(`benchmarks.server_cost`, pinned): fixed limits 16 and 32 cost it 0.92-0.94x the CPU per item
of a 64-connection direct client, 8 about 1.0x, 4 1.08x, 256 1.2-1.3x.

Several limiters in front of one server (bridges on several Ray nodes, the workers of `serve
--workers`) do not see each other's share of its queue: each one's no-load latency is measured
while the others keep the server busy, so each keeps a whole standing queue of its own, N
times the target in all (measured on real mcqa, pinned: one bridge 0.93x the direct client's
CPU per item, two 1.03-1.07x, four 1.02-1.12x). So a limiter told it is one of `share` (`serve
--sharing-bridges`, which the Ray fleet sets, times `--workers`) aims for 1/share of the
queue.

Why Vegas, of the three the issue names: Gradient2 alone compares a short to a long average
latency; it reacts to a sudden change but, as the long average follows the short one, keeps
growing on a server whose latency rises with its load. Vegas's estimate stops at the knee,
given the no-load latency, which is what needs care:

- a call sent while no other call was in flight on its replica (LOW_LOAD), or any call faster
  than the no-load latency, lowers it at once (a server that sped up). Nothing else raises it
  but a re-measurement: a call after a pause can be slow for reasons of its own (uvicorn closes
  connections idle for 5 s, so the next calls connect anew), and a no-load latency raised by
  them would make a queue look like none and the limit double past the knee;
- a re-measurement, as Envoy's adaptive concurrency filter does: the replica's slots drop to
  LOW_LOAD until one call met no queue, then to CALIBRATION_SAMPLES - 1 (no more than the limit it
  ends with) until as many more sent with no more in flight have answered, and the no-load latency
  is the least of theirs; the limit it ends with is where the queue that started it would have been
  QUEUE_LOW. It starts when a queue over the low mark (beyond the tolerance) has held for
  CALIBRATE_AFTER seconds (once re-measured or confirmed, below: or CALIBRATE_TRIPS times the lowest
  no-load latency yet, if longer; the current one may be raised by other bridges' load on the
  server) without a no-load call (a server that slowed down: a latency step looks like a queue), a
  pause without answers restarting that clock; and at once at the first queue with a latency over
  twice the no-load one, since until then the no-load latency is a cold server's first answers (its
  first request, new connections), often ten times the real one, unless CONFIRM_LOAD calls sent at
  once have answered within the tolerance of it: no server whose latency grows with load answers so
  many so fast with such a guess (a one-at-a-time server at 1 ms a call would take a second), and a
  re-measurement begun at the slow tail of a first burst held the next burst for its two round trips
  (measured: docs/performance.md, "16k in flight").
  Unlike Envoy's, it never runs on a server whose latency does not grow with load, whose flow it
  would stall. The first call alone is the no-load latency even at a server that serves one call at
  a time; the other two (each of which may wait for the other there, or be faster) go out together,
  so a re-measurement takes two round trips once the calls before it are answered (one call at a
  time, as it did first, three: the next batch of 16,384 calls at 1 s waited 3 s for it). Envoy
  re-measures with 3 calls at once throughout, which at such a server reads a no-load latency up to
  3 times the real one, and several bridges in front of it each add their 3 to its queue. The round
  trips bound what it costs a slow server whose latency grows with load (an LLM judge), which a
  re-measurement holds to one or two calls for two of its round trips: re-measured every 3 s, one of
  1 s took 3,389 s for 20,000 calls (modelled, one call at a time), every 60 round trips 1,885 s
  (1,856 s with the last two calls together). Envoy re-measures every 60 s. A re-measurement is
  called off, its limit as before, when a call sent before it with QUEUE_LOW or more in flight
  answers within the tolerance: the tail of a burst of thousands on a busy machine has a few slow
  answers among many that met no queue, and a re-measurement begun on one was waited out by the next
  burst, one call at a time (16,384 calls at 1 s: 5.6-6.6 s instead of 2.5 s, one run in four). The
  first one only by a call sent with at least as many in flight as the one that began it: until then
  the no-load latency may be a cold server's, which a queue shorter than the one seen meets within
  the tolerance.
"""

from __future__ import annotations

import math

# The standing queue at a server the limit keeps, calls (module docstring).
QUEUE_LOW = 12.0
QUEUE_HIGH = 24.0
# A latency under TOLERANCE times the no-load one is noise, not a queue, however many calls
# are in flight (Netflix's Gradient2 tolerates 1.5 times its long-run latency the same way).
TOLERANCE = 1.5
# A call sent with at most this many calls in flight on its replica (itself) met no queue.
LOW_LOAD = 1
# The limit of a replica not yet measured.
INITIAL_LIMIT = 20
# What a round trip of answers that met no queue multiplies a limit by.
GROWTH = 8.0
# Seconds (and no-load latencies, if more) a limit held by its queue estimate goes without a
# no-load call before it is re-measured, and the no-load calls a re-measurement takes.
CALIBRATE_AFTER = 3.0
CALIBRATE_TRIPS = 60
CALIBRATION_SAMPLES = 3
# Calls sent at once that, answered within the tolerance of the no-load latency, show it is
# no cold server's first guess (module docstring).
CONFIRM_LOAD = 1000


class Limit:
    """The adaptive concurrency limit of one replica (see the module docstring).

    Args:
        ceiling: the most it may grow to (`--max-in-flight`).
        share: the limiters (this one included) in front of the same server: it keeps
            1/share of the standing queue (the module docstring).

    Attributes:
        size: the slots now, calls: `limit`, or at most CALIBRATION_SAMPLES - 1 while
            re-measuring.
        no_load: the no-load latency now, seconds (inf before the first sample).
        share: `share` above; may be changed at any time (a fleet that grew).
    """

    __slots__ = (
        "_calibrating",
        "_ceiling",
        "_last_low",
        "_measured",
        "_recheck",
        "_last_sample",
        "_limit",
        "_low",
        "no_load",
        "_fastest",
        "share",
        "size",
    )

    def __init__(self, ceiling: int, share: int = 1) -> None:
        self._ceiling = ceiling
        self.share = share
        self._limit = float(min(INITIAL_LIMIT, ceiling))
        self._low: list[float] = []  # a re-measurement's no-load latencies
        self._last_low = self._last_sample = 0.0
        self._calibrating = False
        # a re-measurement an answer that met no queue may call off: the limit it had then,
        # and the least load at which that answer was sent
        self._recheck = (self._limit, math.inf)
        self._measured = False  # not re-measured nor confirmed: the no-load latency is a guess
        self.no_load = self._fastest = math.inf  # and the lowest it has been
        self.size = int(self._limit)

    @property
    def limit(self) -> int:
        """The limit found, calls (1..ceiling)."""
        return int(self._limit)

    def sample(self, rtt: float, load: int, now: float, filled: bool = True) -> int:
        """Take one call's latency `rtt` (seconds, answered 200), sent while `load` calls were
        in flight on the replica (itself included), `filled` if they were at least half its
        `size` then, at `now` (`time.monotonic()`). Returns the new `size`."""
        if self._calibrating:
            return self._calibrate(rtt, load, now)
        if now - self._last_sample > CALIBRATE_AFTER:
            self._last_low = now  # after a pause the first calls meet cold connections
        self._last_sample = now
        if load <= LOW_LOAD or rtt < self.no_load:
            self.no_load = min(self.no_load, rtt)
            self._fastest = min(self._fastest, rtt)
            self._last_low = now
        limit = self._limit
        if rtt <= 0.0:
            return self.size
        queued = load * (1.0 - self.no_load / rtt)  # the calls this one found waiting
        low = max(QUEUE_LOW, 3.0 * math.log10(limit)) / self.share
        high = max(QUEUE_HIGH, 6.0 * math.log10(limit)) / self.share
        at_low = load * self.no_load / rtt + low  # the limit at which this queue would be `low`
        noise = rtt < TOLERANCE * self.no_load  # no queue worth the name, however many calls
        self._measured = self._measured or (noise and load >= CONFIRM_LOAD)
        first = not self._measured and rtt > 2.0 * self.no_load
        trips = CALIBRATE_TRIPS * self._fastest if self._measured else 0.0
        stale = now - self._last_low > max(CALIBRATE_AFTER, trips)
        if queued > low and not noise and (first or stale):
            self._set(min(limit, at_low))  # what the re-measurement ends with
            self._calibrating = True
            self._recheck = (limit, max(QUEUE_LOW, load) if first else QUEUE_LOW)
            self._low.clear()
            self.size = min(LOW_LOAD, self.size)
            return self.size
        if queued > 2.0 * high and rtt > 2.0 * self.no_load:  # far past the knee
            return self._set(min(limit, at_low))
        if load >= QUEUE_LOW and (queued < low / 2.0 or noise):
            # that many at once and no queue: not the knee (module docstring)
            return self._set(limit + GROWTH - 1.0) if filled else self.size
        if load * 2 < limit:
            return self.size  # too few calls to tell of the limit
        if queued < low:
            limit += max(1.0, math.log10(limit))
        elif queued > high:  # one window's answers all see its queue: not past `at_low`
            limit = max(limit - max(1.0, math.log10(limit)), at_low)
        else:
            return self.size
        return self._set(limit)

    def _set(self, limit: float) -> int:
        """The limit is `limit` (bounded to 1..ceiling); returns the new `size`."""
        self._limit = limit = min(max(limit, 1.0), float(self._ceiling))
        self.size = int(limit)
        return self.size

    def _calibrate(self, rtt: float, load: int, now: float) -> int:
        """A sample while re-measuring: first a call sent alone, then calls sent with at most
        CALIBRATION_SAMPLES - 1 in flight; after CALIBRATION_SAMPLES the no-load latency is the
        least of theirs and the limit is back."""
        if load <= (LOW_LOAD if not self._low else CALIBRATION_SAMPLES - 1):
            self._low.append(rtt)
            # the others together, if the limit it ends with allows them
            self.size = min(CALIBRATION_SAMPLES - 1, int(self._limit))
        elif not self._low and load >= self._recheck[1]:
            if rtt < TOLERANCE * self.no_load:  # sent before it, at load, and met no queue
                self._calibrating, self._last_low = False, now
                return self._set(self._recheck[0])
        if len(self._low) >= CALIBRATION_SAMPLES:
            self.no_load = min(self._low)
            self._fastest = min(self._fastest, self.no_load)
            self._last_low = now
            self._calibrating, self._measured = False, True
            self.size = int(self._limit)
        return self.size
