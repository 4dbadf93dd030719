"""One `RunStream` call kept open (grpc.aio): rollouts are written whenever the caller has them,
and each result is handed over as it arrives, for a trainer that keeps rollouts in flight
instead of sending batches (`trl_async.py`).

    stream = LiveRunStream(stub, timeout=3600.0, metadata=None, on_result=f, on_end=g)
    stream.start()
    await stream.send([run_request, ...])   # any time, any number of times
    await stream.half_close()               # the bridge finishes what it holds, then ends OK
    stream.cancel()                         # the bridge closes every agent request it holds

The stream's semantics are RunStream's (`rollout.proto`): results come back as rollouts finish,
tagged with `request_id`, every item sent gets exactly one result, half-close ends the call OK
once the items in flight are answered. What this class adds: which items are in flight, and
what happens to them when the call ends. `on_result(request_id, outcome)` is called once per
item answered (the `RunResponse`, or a `Failure` from its `error`); `on_end(stream, failure,
unanswered)` once, when the call has ended: `failure` is None when it ended OK, else the call's
own `Failure` (marked `whole_call`), and `unanswered` the request_ids sent that got no result
(they are the caller's to fail or to send again). An item bigger than the message limit is
answered at once with INVALID_ARGUMENT / ITEM_TOO_LARGE, without being sent, as in
`client.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc

from nemo_gym_grpc.rewards.client import MAX_ITEM_BYTES, _chunks
from nemo_gym_grpc.rewards.outcomes import ITEM_TOO_LARGE, Failure, RunOutcome
from nemo_gym_grpc.v1 import rollout_pb2, rollout_pb2_grpc

OnResult = Callable[[str, RunOutcome], None]
OnEnd = Callable[["LiveRunStream", Failure | None, list[str]], None]


class LiveRunStream:
    """One open `RunStream` call on a grpc.aio channel (see the module docstring).

    Args:
        stub: a RolloutService stub on a grpc.aio channel (`RolloutServiceStub(aio_channel)`).
        timeout: the call's gRPC deadline, seconds from `start()`.
        metadata: call metadata (the bearer token), or None.
        on_result: called with (request_id, outcome) for each item answered.
        on_end: called once with (this stream, the call's failure or None, unanswered ids).

    Attributes:
        in_flight: request_id -> the RunRequest, for the items sent and not yet answered.
        started_at: `time.monotonic()` of `start()` (None before).
        ended: the call has ended (on_end was called).
        closed: `half_close()` was called (no more items may be sent).
    """

    def __init__(
        self,
        stub: rollout_pb2_grpc.RolloutServiceAsyncStub,
        *,
        timeout: float,
        metadata: tuple[tuple[str, str], ...] | None,
        on_result: OnResult,
        on_end: OnEnd,
    ) -> None:
        self._stub = stub
        self._timeout = timeout
        self._metadata = metadata
        self._on_result = on_result
        self._on_end = on_end
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self.in_flight: dict[str, rollout_pb2.RunRequest] = {}
        self.started_at: float | None = None
        self.ended = False
        self.closed = False

    def start(self) -> None:
        """Open the call (the connection is waited for, within the deadline) and start
        reading its results. Call on the event loop that owns the stub's channel."""
        self.started_at = time.monotonic()
        self._call = self._stub.RunStream(
            timeout=self._timeout, metadata=self._metadata, wait_for_ready=True
        )
        self._reader = asyncio.create_task(self._read(), name="run-stream-reader")

    def age(self) -> float:
        """Seconds since `start()`."""
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    async def send(
        self, requests: Sequence[rollout_pb2.RunRequest]
    ) -> list[rollout_pb2.RunRequest]:
        """Write `requests` (unique request_ids, not in flight on this stream) as stream
        messages of at most 64 items. Items too large are answered at once without being
        sent.

        Returns:
            The requests not sent because the call had ended first (the caller's to send
            elsewhere); items sent are answered through `on_result` or handed to `on_end`.

        Raises:
            RuntimeError: the stream is half-closed or was never started.
        """
        if self.closed or self._call is None:
            raise RuntimeError("items sent on a RunStream that is half-closed or not started")
        sendable = []
        for request in requests:
            size = request.ByteSize()
            if size > MAX_ITEM_BYTES:
                message = f"item is {size} bytes; the gRPC message limit is {MAX_ITEM_BYTES}"
                failure = Failure("INVALID_ARGUMENT", ITEM_TOO_LARGE, message)
                self._on_result(request.request_id, failure)
            else:
                sendable.append(request)
        chunks = list(_chunks(sendable))
        for number, chunk in enumerate(chunks):
            if self.ended:  # on_end has run: nothing registered now would be reported
                return [request for later in chunks[number:] for request in later]
            for request in chunk:
                self.in_flight[request.request_id] = request
            try:
                await self._call.write(rollout_pb2.RunStreamRequest(items=chunk))
            except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                pass  # the call ended: the reader hands these items to on_end
        return []

    async def half_close(self) -> None:
        """Send no more items; the bridge finishes those it holds and ends the call OK."""
        if self.closed or self._call is None:
            return
        self.closed = True
        try:
            await self._call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # already ended

    def cancel(self) -> None:
        """Cancel the call: the bridge closes every agent HTTP request it holds for it. The
        items in flight are handed to `on_end` as unanswered, with a CANCELLED failure."""
        self.closed = True
        if self._call is not None:
            self._call.cancel()

    async def wait_ended(self) -> None:
        """Return once the call has ended and `on_end` has run."""
        if self._reader is not None:
            await asyncio.shield(self._reader)

    async def _read(self) -> None:
        failure: Failure | None = None
        try:
            async for message in self._call:
                for result in message.results:
                    if self.in_flight.pop(result.request_id, None) is None:
                        self._call.cancel()
                        failure = Failure(
                            "INTERNAL",
                            None,
                            f"the bridge answered request_id {result.request_id[:100]!r}, "
                            "which is not in flight on this stream",
                        )
                        break
                    error = result.error if result.HasField("error") else None
                    outcome = result if error is None else Failure.from_status(error)
                    self._on_result(result.request_id, outcome)
                if failure is not None:
                    break
        except grpc.aio.AioRpcError as error:
            failure = Failure.from_rpc_error(error)
        except asyncio.CancelledError:
            failure = Failure("CANCELLED", None, "the RunStream was cancelled by the client")
        if failure is None and self.in_flight:
            failure = Failure(
                "INTERNAL",
                None,
                f"the bridge ended RunStream OK with {len(self.in_flight)} items unanswered",
            )
        if failure is None and self._call.cancelled():
            failure = Failure("CANCELLED", None, "the RunStream was cancelled by the client")
        self.ended = True
        unanswered = list(self.in_flight)
        self.in_flight.clear()
        self._on_end(
            self, None if failure is None else replace(failure, whole_call=True), unanswered
        )
