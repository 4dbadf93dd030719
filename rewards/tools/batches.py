"""The scoring loop of `nemo-gym-grpc score`: batches of rows out, records appended to OUT in
input order.

Each batch is one `VerifyStream` call (`Route.asend`), at most `concurrency` at once, all on
the running event loop. Finished batches wait in a reorder buffer (at most 2 x `concurrency`
batches) and are appended strictly in input order and flushed, so OUT is always the records of
an input prefix.

Only verdicts are written (`scorefile.is_verdict`). Rows whose outcome says nothing about the
row (the call failed as a whole, or the bridge reports its server unreachable, unknown, ...)
are sent again, alone, after a pause (3 attempts in all while the cause is UNAVAILABLE,
DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED); if that does not give them a verdict, the run stops
(`NoVerdict`) and nothing of that batch is written, so a rerun scores it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

from nemo_gym_grpc.rewards.client import resend, stream
from nemo_gym_grpc.rewards.client.outcomes import Failure, Outcome
from nemo_gym_grpc.rewards.client.stream import Route
from nemo_gym_grpc.rewards.tools import scorefile

CALL_ATTEMPTS = 3
CALL_BACKOFF = 1.0  # seconds before attempt n + 1: n x this (1 s, then 2 s)

log = logging.getLogger(__name__)

Record = dict[str, Any]


class NoVerdict(RuntimeError):
    """Rows of a batch got no verdict (the call failed as a whole, or their server could not
    be reached or routed) and sending them again did not help; the run stops."""


def _chunks(rows: Iterator[scorefile.Row], size: int) -> Iterator[list[scorefile.Row]]:
    chunk: list[scorefile.Row] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _no_verdict(route: Route, failure: Failure, rows: int, attempts: int) -> NoVerdict:
    tried = f"{attempts} attempt{'s' if attempts > 1 else ''}"
    if failure.whole_call:
        what = f"a call to the bridge at {route.label} failed as a whole ({tried})"
    else:
        what = f"{rows} rows got no verdict ({tried}; not about the rows themselves)"
    return NoVerdict(f"{what}: {failure.cause}: {failure.message}")


class FileScorer:
    """One run over the pending rows, on the running event loop.

    Args:
        route: where the calls go (a concrete bridge target; `Route.send`'s terms).
        concurrency: calls in flight at once.
        stop: set it (e.g. from a signal handler) to end the run early.
    """

    def __init__(self, route: Route, *, concurrency: int, stop: asyncio.Event) -> None:
        self.route = route
        self.concurrency = concurrency
        self.stop = stop
        self.calls = asyncio.Semaphore(concurrency)
        self.written = 0

    async def score_chunk(self, rows: Sequence[scorefile.Row]) -> list[Record]:
        """The records of `rows`, in order; rows without a verdict are sent again.

        Raises:
            NoVerdict: rows kept getting no verdict.
            ProtocolError: the bridge broke the VerifyStream contract.
        """
        todo = [row.request for row in rows if row.request is not None]
        outcomes: dict[str, Outcome] = {}
        async with self.calls:
            for attempt in range(1, CALL_ATTEMPTS + 1):
                failure: Failure | None = None
                sent = await self.route.asend(stream.VERIFY, todo)
                for request_id, outcome in sent.items():
                    if scorefile.is_verdict(outcome):
                        outcomes[request_id] = outcome
                    elif isinstance(outcome, Failure) and (failure is None or outcome.whole_call):
                        failure = outcome
                todo = [request for request in todo if request.request_id not in outcomes]
                if failure is None:
                    break
                if not resend.send_again(failure) or attempt == CALL_ATTEMPTS:
                    raise _no_verdict(self.route, failure, len(todo), attempt)
                log.warning(
                    "%d rows got no verdict (%s); sending them again", len(todo), failure.cause
                )
                await asyncio.sleep(attempt * CALL_BACKOFF)
        return [scorefile.record(row, row.failure or outcomes[row.request_id]) for row in rows]

    async def run(
        self,
        rows: Iterator[scorefile.Row],
        batch_size: int,
        out: BinaryIO,
        on_write: Callable[[list[Record]], None],
    ) -> bool:
        """Score `rows`, appending records to the binary file `out` in input order.

        At most `concurrency` calls are in flight and 2 x `concurrency` batches are started
        ahead of the first unwritten one. `on_write(records)` is called after each flushed
        write. Returns True when every row was written, False when stopped early; the calls
        still in flight are cancelled before it returns.

        Raises:
            NoVerdict, ProtocolError: from a batch; OUT keeps the prefix before it.
        """
        chunks = _chunks(rows, batch_size)
        started: deque[asyncio.Task[list[Record]]] = deque()  # in input order
        stopped = asyncio.ensure_future(self.stop.wait())
        exhausted = False
        try:
            while True:
                while not exhausted and not self.stop.is_set():
                    if len(started) == 2 * self.concurrency:
                        break
                    chunk = next(chunks, None)
                    if chunk is None:
                        exhausted = True
                    else:
                        started.append(asyncio.create_task(self.score_chunk(chunk)))
                if exhausted and not started:
                    return True
                await asyncio.wait([*started, stopped], return_when=asyncio.FIRST_COMPLETED)
                self._write_ready(started, out, on_write)
                if self.stop.is_set():
                    return False
        finally:
            stopped.cancel()
            for task in started:
                task.cancel()
            await asyncio.gather(stopped, *started, return_exceptions=True)

    def _write_ready(
        self,
        started: deque[asyncio.Task[list[Record]]],
        out: BinaryIO,
        on_write: Callable[[list[Record]], None],
    ) -> None:
        """Raise the first error of a finished batch; append the finished batches at the
        head of `started` (taking them off it)."""
        for task in started:
            error = task.exception() if task.done() else None
            if error is not None:
                try:
                    raise error
                finally:
                    del error  # bridge/errors.py: no reference cycle through this frame
        while started and started[0].done():
            records = started.popleft().result()
            out.write(b"".join(scorefile.dumps(r) for r in records))
            out.flush()
            self.written += len(records)
            on_write(records)
