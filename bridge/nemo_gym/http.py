"""The HTTP exchange with a NeMo Gym server: one POST with its error mapping, and the liveness
probe `GET /`.

Every POST carries the item's `request_id` as an `X-Request-Id` header, so NeMo Gym's access
logs (and the tests' fault proxy) can tell items apart.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.cookies import Morsel
from urllib.parse import quote

import aiohttp
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym import reports

log = logging.getLogger(__name__)

LIVENESS_PATH = "/"
REQUEST_ID_HEADER = "X-Request-Id"

# Longest X-Request-Id value sent, characters (uvicorn refuses very large header blocks).
_MAX_REQUEST_ID_HEADER = 200


def exact_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """aiohttp's total timeout of `seconds`, fired at that time: aiohttp otherwise rounds a
    timeout over 5 s (`ceil_threshold`) up to the event loop's next whole second, up to 1 s
    late, which would overrun the margin kept back from an RPC deadline
    (`verifier.time_left`)."""
    return aiohttp.ClientTimeout(total=seconds, ceil_threshold=math.inf)


def request_id_header(request_id: str) -> str:
    """The `X-Request-Id` value for `request_id`: itself when it is printable ASCII, else
    percent-encoded (UTF-8); cut to 200 characters either way."""
    if not (request_id.isascii() and request_id.isprintable()):
        request_id = quote(request_id, safe="", errors="replace")
    return request_id[:_MAX_REQUEST_ID_HEADER]


@dataclass(frozen=True, slots=True)
class Reply:
    """An upstream's answer to one POST: HTTP status, body, the cookies it set, the seconds
    from sending the request to reading the whole body, and its failure report header
    (`reports.bounded`; "" without one)."""

    status: int
    body: bytes
    cookies: Mapping[str, Morsel[str]]
    seconds: float
    failure_report: str = ""


class Refused(errors.ItemError):
    """UNAVAILABLE / UPSTREAM_UNAVAILABLE because the upstream refused the connection (the
    caller may pass that replica over for a while)."""


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    *,
    timeout: float,
    request_id: str,
    cookie: str = "",
    queued: float = 0.0,
) -> Reply:
    """One JSON POST to `url` (redirects are not followed: only configured URLs are called).

    Args:
        url: full URL, e.g. "http://127.0.0.1:18001/verify"; `body`: UTF-8 JSON.
        timeout: seconds for the whole exchange (> 0).
        request_id: the item's request_id, sent as `X-Request-Id` (`request_id_header`).
        cookie: the `Cookie` header, "" for none.
        queued: seconds the call waited for a slot before (reported on a timeout).

    Returns:
        The Reply, whatever its HTTP status.

    Raises:
        errors.ItemError: DEADLINE_EXCEEDED / UPSTREAM_TIMEOUT when `timeout` passed,
            UNAVAILABLE / UPSTREAM_UNAVAILABLE for a transport failure (`Refused` when the
            connection was refused); its `latency_seconds` is the time spent.
    """
    header = request_id_header(request_id)
    headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: header}
    if cookie:
        headers["Cookie"] = cookie
    started = time.monotonic()
    try:
        async with session.post(
            url,
            data=body,
            headers=headers,
            timeout=exact_timeout(timeout),
            allow_redirects=False,
        ) as reply:
            raw = await reply.read()
            seconds = time.monotonic() - started
            log.debug("%s: HTTP %d, %.3f s, request_id=%s", url, reply.status, seconds, header)
            report = reports.bounded(reply.headers.get(reports.HEADER))
            return Reply(reply.status, raw, reply.cookies, seconds, report)
    except (asyncio.TimeoutError, TimeoutError):
        error = _timed_out(url, timeout, queued)
    except aiohttp.ClientError as exc:
        error = _unreachable(url, exc)
    error.latency_seconds = time.monotonic() - started
    raise error


def _timed_out(url: str, timeout: float, queued: float) -> errors.ItemError:
    return errors.ItemError(
        code_pb2.DEADLINE_EXCEEDED,
        errors.UPSTREAM_TIMEOUT,
        f"{url} did not answer within {timeout:.3f} s",
        upstreamUrl=url,
        timeoutSeconds=f"{timeout:.3f}",
        queuedSeconds=f"{queued:.3f}",
    )


def _unreachable(url: str, exc: aiohttp.ClientError) -> errors.ItemError:
    kind = Refused if isinstance(exc, aiohttp.ClientConnectorError) else errors.ItemError
    return kind(
        code_pb2.UNAVAILABLE,
        errors.UPSTREAM_UNAVAILABLE,
        f"{url} unreachable: {type(exc).__name__}: {exc}",
        upstreamUrl=url,
    )


async def answers(session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
    """True when the resources server at base URL `url` answers its liveness route `GET /`
    with 200 within `timeout` seconds."""
    try:
        async with session.get(f"{url}{LIVENESS_PATH}", timeout=exact_timeout(timeout)) as reply:
            return reply.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
