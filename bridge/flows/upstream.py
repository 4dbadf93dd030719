"""The one upstream call path of every flow (verify, run, and the session calls to come): each
attempt's POST with its timeout cut to the RPC deadline, its latency counted, a refused
connection passing the replica over (`post`), and its reply read into the flow's result or a
failure that carries the call's latency and the server's failure report (`read`). Each flow
builds its bodies, reads its replies and drives its attempts (`attempts.Attempts`, in the loop
its docstring shows).

Measured on the bridge's hot path (benchmarks/experiments/side_by_side.py, CPU per item against
the commit before): the flows hand their steps over as functions and arguments, not closures
(a lambda, a partial and a closure per item cost 10-15 us more), and the attempts loop stays in
each flow's own coroutine (a shared coroutine around it, one more frame for every resumption,
cost 4-6 us more).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows import attempts
from nemo_gym_grpc.bridge.flows.balancer import Replica
from nemo_gym_grpc.bridge.nemo_gym import http, reports
from nemo_gym_grpc.bridge.nemo_gym.http import Refused, Reply

T = TypeVar("T")


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
            metric; called once, also when the call fails or is cancelled. A 200 reply is
            also a sample of the replica's adaptive limit, when it has one.
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
    load = replica.in_flight
    filled = load * 2 >= replica.size
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
    if replica.limit is not None and reply.status == 200:
        replica.answered(reply.seconds, load, filled)
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
        errors.ItemError: the status error or the reader's, with the call's latency, the
            reply's failure report (`reports.attach`) and, for a 3xx, where it pointed.
    """
    try:
        if reply.status != 200:
            raise status_error(reply.status, url, reply.body)
        return reader(reply.body, url, *args)
    except errors.ItemError as exc:
        exc.latency_seconds = reply.seconds
        reports.attach(exc, reply.failure_report)
        note_redirect(exc, reply)
        raise


def note_redirect(error: errors.ItemError, reply: Reply) -> None:
    """When `reply` is a 3xx with a Location, say in `error` where it pointed (its message and
    `redirectLocation`): redirects are not followed."""
    if reply.location and 300 <= reply.status < 400:
        where = errors.upstream_text(reply.location, 200)
        error.message += f"; a redirect to {where}, not followed"
        error.metadata["redirectLocation"] = where
