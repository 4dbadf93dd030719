"""A long-lived feed of rollouts over `RunStream` (`RunFeed`): requests are sent whenever the
caller has them and each outcome is handed over as it arrives, for a trainer that keeps
rollouts in flight instead of sending batches (the AsyncGRPOTrainer worker,
`trl/worker_engine.py`).

Built on the batch call's parts (`stream.py`): a `Route` says where the calls go (the configured
target or the embedded bridge, TLS, token) and the deadline of each call (`Route.timeout`), and
each call keeps its books in a `stream.Call` of `stream.RUN` (unique request_ids, the item size
limit, messages of at most 64 items, results matched by request_id, one outcome per item, the
call's own failure for the items it left unanswered). What stays separate, and why: a batch
call knows its items before it starts and returns once all are answered (`stream.send` /
`asend`); a feed never knows its last item and outlives any one call. So here:

- items are written as they come (`LiveCall`: grpc.aio's `write`, not a request iterator) and
  each outcome is taken off the books as it arrives (`Call.take`): memory holds what is in
  flight, not what was answered;
- a call takes new items for the first half of its deadline, then is half-closed (the bridge
  finishes what it holds and ends it OK) and a new call takes over: no call lives without a
  deadline, and every item has at least half of one; a call the bridge ends for sitting idle
  (`resend.rotated`) is replaced the same way, not counted as a failure;
- the items of a call that fails as a whole (bridge restarted, connection lost) are sent again
  on the next call under a new request_id (`<id>-r<N>`, so NeMo Gym never sees one rollout id
  twice), after a pause growing with the failures in a row (RECONNECT_DELAYS): a training run
  outlives a bridge restart, where a batch call gives them the call's failure. They may have
  been fine; the caller counts them (`resent_rollouts`). A call-level failure that sending
  again cannot fix (`resend.PERMANENT`: token refused, no such service, a message refused) makes
  `tick` raise.

The bridge counts as down (`RunFeed.down_since`) from the start, and from a call's failure,
until a result arrives or a call has stayed open SETTLED_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc

from nemo_gym_grpc.rewards.client import channels, resend, stream
from nemo_gym_grpc.rewards.client.outcomes import Failure, ProtocolError, RunOutcome
from nemo_gym_grpc.rewards.client.stream import Route
from nemo_gym_grpc.v1 import rollout_pb2

log = logging.getLogger("nemo_gym_grpc.rewards")

SETTLED_SECONDS = 2.0  # a call open this long without failing: the bridge counts as up
RECONNECT_DELAYS = (0.5, 1.0, 2.0, 5.0)  # s before reopening after the n-th failure in a row
CONNECT_PROBE = 1.0  # s one `tick` waits for a connection to the bridge
STOP_WAIT = 10.0  # s a closing feed waits for its cancelled calls to end

RunCall = stream.Call[rollout_pb2.RunRequest, rollout_pb2.RunResponse, rollout_pb2.RunStreamRequest]
OnResult = Callable[[str, RunOutcome], None]
OnEnd = Callable[["LiveCall", "Failure | None", list[str]], None]


class LiveCall:
    """One `RunStream` call kept open on a grpc.aio channel, its books in a `stream.Call`.

    Args:
        call: the books (`Route.call(stream.RUN, address, [])`); its deadline runs from their
            creation.
        on_result: called with (request_id, outcome) once per item answered.
        on_end: called once, when the call has ended, with (this call, None when it ended OK
            or else its own `Failure`, marked `whole_call`, the request_ids booked and left
            unanswered).
    """

    def __init__(self, call: RunCall, on_result: OnResult, on_end: OnEnd) -> None:
        self.call = call
        self._on_result = on_result
        self._on_end = on_end
        self._responses: Any = None
        self._reader: asyncio.Task[None] | None = None
        self.started_at = time.monotonic()
        self.ended = False
        self.closed = False

    def start(self, channel: grpc.aio.Channel) -> None:
        """Open the call on `channel` and start reading its results (on the channel's loop)."""
        _, left = self.call.start()
        self._responses = stream.RUN.aio_method(channel)(
            timeout=left, metadata=self.call.metadata, wait_for_ready=True
        )
        self._reader = asyncio.create_task(self._read(), name="run-stream-reader")

    def age(self) -> float:
        """Seconds since the call's books were made (its deadline runs from then)."""
        return time.monotonic() - self.started_at

    async def send(self, requests: Sequence[rollout_pb2.RunRequest]) -> bool:
        """Book and write `requests`. Items too large are answered at once (`on_result`),
        without being sent; items booked but not written before the call ended are among
        `on_end`'s unanswered.

        Returns:
            False when the call had ended already (nothing was booked), else True.

        Raises:
            RuntimeError: the call is half-closed or was never started.
            ValueError: a request_id is booked on this call already.
        """
        if self.closed or self._responses is None:
            raise RuntimeError("items sent on a RunStream that is half-closed or not started")
        if self.ended:
            return False
        sendable = self.call.add(requests)
        for request in requests:
            if request.request_id in self.call.outcomes:
                self._on_result(request.request_id, self.call.take(request.request_id))
        for chunk in resend.chunks(sendable):
            if self.ended:
                break
            try:
                await self._responses.write(stream.RUN.message(chunk))
            except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                break  # the call ended: the reader hands the items booked to on_end
        return True

    async def half_close(self) -> None:
        """Send no more items; the bridge finishes those it holds and ends the call OK."""
        if self.closed or self._responses is None:
            return
        self.closed = True
        try:
            await self._responses.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # already ended

    def cancel(self) -> None:
        """Cancel the call: the bridge closes every agent request it holds for it; the items
        booked go to `on_end` as unanswered, with a CANCELLED failure."""
        self.closed = True
        if self._responses is not None:
            self._responses.cancel()

    async def wait_ended(self) -> None:
        """Return once the call has ended and `on_end` has run."""
        if self._reader is not None:
            await asyncio.shield(self._reader)

    async def _read(self) -> None:
        call = self.call
        try:
            with call.reading(self._responses):
                async for message in self._responses:
                    for result in message.results:
                        call.on_message([result])  # ProtocolError: unknown or repeated id
                        self._on_result(result.request_id, call.take(result.request_id))
        except ProtocolError as error:
            call.failure = Failure("INTERNAL", None, str(error))
        except asyncio.CancelledError:
            call.failure = Failure("CANCELLED", None, "the RunStream was cancelled by the client")
        if call.failure is None and self._responses.cancelled():
            call.failure = Failure("CANCELLED", None, "the RunStream was cancelled by the client")
        self.ended = True
        try:
            unanswered = list(call.finish())
        except ProtocolError as error:  # ended OK with items unanswered
            call.failure = Failure("INTERNAL", None, str(error))
            unanswered = list(call.finish())
        failure = None if call.failure is None else replace(call.failure, whole_call=True)
        self._on_end(self, failure, unanswered)


class RunFeed:
    """Requests over successive `RunStream` calls to one bridge, on one asyncio loop (see the
    module docstring). Use as `async with RunFeed(...) as feed:`; call `tick()` now and then
    (at least every second or so) and `send()` whenever there are requests.

    Args:
        route: where the calls go, on what terms; `route.timeout` is each call's deadline.
        address: the bridge's target (`route.address()`, resolved by the caller, so that an
            embedded bridge starts outside the loop).
        on_outcome: called with (request_id as given to `send`, outcome) once per request.
        on_send: called with a request_id each time it is written on a call (again after a
            call failed), or None.
        counts: where `streams` (calls opened) and `resent_rollouts` are counted.

    Attributes:
        down_since: `time.monotonic()` since when the bridge counts as down, or None.
        last_failure: the last call-level failure (or lack of a connection), or None.
        fatal: the `resend.PERMANENT` failure that ended the feed, or None.
    """

    def __init__(
        self,
        route: Route,
        address: str,
        on_outcome: OnResult,
        *,
        on_send: Callable[[str], None] | None = None,
        counts: Counter[str] | None = None,
    ) -> None:
        self.route = route
        self.address = address
        self.counts: Counter[str] = Counter() if counts is None else counts
        self.down_since: float | None = time.monotonic()
        self.last_failure: Failure | None = None
        self.fatal: Failure | None = None
        self._on_outcome = on_outcome
        self._on_send = on_send
        self._channel: grpc.aio.Channel | None = None
        self._current: LiveCall | None = None
        self._calls: set[LiveCall] = set()
        self._requests: dict[str, rollout_pb2.RunRequest] = {}  # in flight, by the caller's id
        self._wire: dict[str, str] = {}  # request_id on a call -> the caller's
        self._attempts: Counter[str] = Counter()  # the caller's id -> calls that failed it
        self._pending: deque[str] = deque()  # the caller's ids, for the next write
        self._failures_in_row = 0
        self._next_open = 0.0
        self._closing = False

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered (those waiting to be sent again included)."""
        return len(self._requests)

    async def __aenter__(self) -> RunFeed:
        self._channel = channels.aio_channel(self.address, self.route.security)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Cancel every call (the bridge closes the agents' requests), wait for them to end
        (at most STOP_WAIT), close the channel. Requests unanswered get no outcome."""
        self._closing = True
        for call in list(self._calls):
            call.cancel()
        ends = [asyncio.ensure_future(call.wait_ended()) for call in self._calls]
        if ends:
            await asyncio.wait(ends, timeout=STOP_WAIT)
        if self._channel is not None:
            await self._channel.close()

    async def tick(self) -> bool:
        """Keep a call open: half-close the current one at half its deadline, open a new one
        when none is (once the pause after a failure is over and a connection is there,
        waited for at most CONNECT_PROBE), write what waits to be sent again.

        Returns:
            True when a call is open to take requests.

        Raises:
            RuntimeError: the bridge refused a call for good (`resend.PERMANENT`).
        """
        if self.fatal is not None:
            failure = self.fatal
            raise RuntimeError(
                f"the bridge at {self.address} refused the RunStream: {failure.cause}: "
                f"{failure.message}"
            )
        current = self._current
        if current is not None and current.age() >= self.route.timeout / 2:
            self._current = None  # it finishes what it holds, then ends OK
            await current.half_close()
            current = None
        if current is None and time.monotonic() >= self._next_open:
            assert self._channel is not None, "RunFeed used outside `async with`"
            try:
                await asyncio.wait_for(self._channel.channel_ready(), CONNECT_PROBE)
            except asyncio.TimeoutError:
                message = f"no connection to the bridge at {self.address}"
                self._down(Failure("UNAVAILABLE", None, message))
                return False
            current = self._open(self._channel)
        if current is None:
            return False
        if current.age() >= SETTLED_SECONDS:
            self._up()
        if self._pending:
            await self._write(current)
        return True

    async def send(self, requests: Sequence[rollout_pb2.RunRequest]) -> None:
        """Send `requests` (request_ids unique among those in flight) on the open call, or on
        the next one. Each gets one outcome through `on_outcome`, unless the feed closes
        first."""
        for request in requests:
            self._requests[request.request_id] = request
            self._pending.append(request.request_id)
        if self._current is not None:
            await self._write(self._current)

    def _open(self, channel: grpc.aio.Channel) -> LiveCall:
        books = self.route.call(stream.RUN, self.address, [])
        call = self._current = LiveCall(books, self._on_result, self._on_end)
        call.start(channel)
        self._calls.add(call)
        self.counts["streams"] += 1
        return call

    async def _write(self, call: LiveCall) -> None:
        keys = list(self._pending)
        self._pending.clear()
        wire = [self._wire_request(key) for key in keys]
        for key in keys:
            if self._on_send is not None:
                self._on_send(key)
        if not await call.send(wire):  # the call had ended: all wait for the next one
            for request in wire:
                self._wire.pop(request.request_id, None)
            self._pending.extendleft(reversed(keys))

    def _wire_request(self, key: str) -> rollout_pb2.RunRequest:
        """The request of `key` as it goes on a call: the caller's, or after a failed call a
        copy under a new request_id."""
        request = self._requests[key]
        attempt = self._attempts[key]
        if attempt:
            request = rollout_pb2.RunRequest()
            request.CopyFrom(self._requests[key])
            request.request_id = f"{key}-r{attempt}"
        self._wire[request.request_id] = key
        return request

    def _on_result(self, request_id: str, outcome: RunOutcome) -> None:
        key = self._wire.pop(request_id, None)
        if key is None or self._requests.pop(key, None) is None:
            return
        self._attempts.pop(key, None)
        self._up()  # a result: the bridge works
        self._on_outcome(key, outcome)

    def _on_end(self, call: LiveCall, failure: Failure | None, unanswered: list[str]) -> None:
        self._calls.discard(call)
        if call is self._current:
            self._current = None
        if self._closing:
            return
        keys = [self._wire.pop(wire_id) for wire_id in unanswered if wire_id in self._wire]
        for key in keys:
            self._attempts[key] += 1
        self._pending.extendleft(reversed(keys))
        self.counts["resent_rollouts"] += len(keys)
        if failure is None or resend.rotated(failure):
            return
        if failure.code in resend.PERMANENT:
            self.fatal = failure
            return
        log.warning(
            "RunStream to the bridge at %s failed (%s: %s); %d requests in flight are sent "
            "again on the next call",
            self.address,
            failure.cause,
            failure.message[:300],
            len(keys),
        )
        self._down(failure)

    def _up(self) -> None:
        self.down_since = None
        self._failures_in_row = 0

    def _down(self, failure: Failure) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
        self.last_failure = failure
        delay = RECONNECT_DELAYS[min(self._failures_in_row, len(RECONNECT_DELAYS) - 1)]
        self._failures_in_row += 1
        self._next_open = now + delay
