"""The one upstream call path of every flow (verify, run, and the session calls to come): an
item's attempts on its replicas (`attempted`), and each attempt's POST with its timeout cut to
the RPC deadline, its latency counted, a refused connection passing the replica over (`post`),
and its reply read into the flow's result or a failure that carries the call's latency and the
server's failure report (`read`). Each flow only builds its bodies and reads its replies.

The flows hand their own steps over as functions and their arguments, not as closures: an item
that made a closure or a `functools.partial` per call cost the bridge 10-15 us of CPU more
(measured with benchmarks/experiments/side_by_side.py; py-spy put it in garbage collection),
since each is a new object the collector has to visit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows import attempts
from nemo_gym_grpc.bridge.flows.attempts import Attempts
from nemo_gym_grpc.bridge.flows.balancer import Replica
from nemo_gym_grpc.bridge.nemo_gym import http, reports
from nemo_gym_grpc.bridge.nemo_gym.http import Refused, Reply

T = TypeVar("T")


async def attempted(
    tries: Attempts,
    attempt: Callable[..., Awaitable[T]],
    *args: Any,
    may_retry: Callable[[errors.ItemError], bool] | None = None,
    retrying: Callable[..., None] | None = None,
) -> T:
    """`attempt(replica, number, *args)` (number 1 = the first) on the replicas `tries` picks,
    until one returns or a failure is final (`Attempts.again`: `may_retry(failure)` when given,
    else the failure's `retryable`). `retrying(failure, *args)` runs before each retry.

    Raises:
        errors.ItemError: the final failure, with its `attempts` metadata.
    """
    while True:
        replica = tries.next()
        try:
            return await attempt(replica, tries.number, *args)
        except errors.ItemError as exc:
            await tries.again(exc, None if may_retry is None else may_retry(exc))
            if retrying is not None:
                retrying(exc, *args)


async def post(
    client: http.Client,
    replica: Replica,
    url: str,
    body: bytes,
    *,
    request_id: str,
    item_timeout: float,
    default_timeout: float,
    deadline: float | None,
    record: Callable[..., None],
    labels: tuple[str, ...],
    cookie: str = "",
    queued: float = 0.0,
) -> Reply:
    """One POST of `body` to `url` on `replica` (`nemo_gym.http.post`), whatever its HTTP status.

    Args:
        item_timeout, default_timeout: the item's own seconds for the call (0 = not set),
            else its flow's default, cut to what the RPC `deadline` (`time.monotonic()`
            seconds, or None) leaves (`attempts.call_timeout`).
        record, labels: `record(*labels, seconds)` counts the call in the flow's latency
            metric; called once, also when the call fails or is cancelled.
        cookie: the `Cookie` header, "" for none.
        queued: seconds the item waited for a slot before (reported on a timeout).

    Raises:
        errors.ItemError: `attempts.NotSent` when the deadline left no time to send; the
            POST's failure otherwise (`Refused`: the replica is passed over while another is
            available).
        asyncio.CancelledError: the RPC was cancelled; the request is closed.
    """
    timeout = attempts.call_timeout(item_timeout, default_timeout, deadline)
    if timeout <= 0:
        situation = f"before anything could be sent to {url}"
        if queued:
            situation = f"while waiting {queued:.3f} s for a free slot to {url}"
        raise attempts.deadline_passed(
            situation, upstreamUrl=url, queuedSeconds=f"{queued:.3f}" if queued else None
        )
    started = time.monotonic()
    try:
        reply = await http.post(
            client, url, body, timeout=timeout, request_id=request_id, cookie=cookie, queued=queued
        )
    except errors.ItemError as exc:
        if isinstance(exc, Refused):
            replica.refused()
        record(*labels, exc.latency_seconds)
        raise
    except asyncio.CancelledError:  # the request is closed; it still took this long
        record(*labels, time.monotonic() - started)
        raise
    record(*labels, reply.seconds)
    return reply


def read(
    reply: Reply,
    url: str,
    reader: Callable[..., T],
    *args: Any,
    status_error: Callable[[int, str, bytes], errors.ItemError] = errors.http_status_error,
) -> T:
    """`reader(body, url, *args)` of a 200 `reply` from `url`; any other status is
    `status_error(status, url, body)`.

    Raises:
        errors.ItemError: the status error or the reader's, with the call's latency and the
            reply's failure report (`reports.attach`).
    """
    try:
        if reply.status != 200:
            raise status_error(reply.status, url, reply.body)
        return reader(reply.body, url, *args)
    except errors.ItemError as exc:
        exc.latency_seconds = reply.seconds
        reports.attach(exc, reply.failure_report)
        raise
