"""The HTTP exchange with a NeMo Gym server: one POST with its error mapping, and the liveness
probe `GET /`.

A POST goes over `bridge.plain_http` to an `http://` URL (about a fifth of aiohttp's CPU per
request, docs/performance.md) and over the aiohttp session to an `https://` one, or to any URL
with `--upstream-client aiohttp`; both close a cancelled request's connection at once (NeMo Gym
0.7 then cancels its handler) and tell a refused connection (`Refused`: nothing was sent) from
one that broke after sending. Every POST carries the item's `request_id` as an `X-Request-Id`
header, so NeMo Gym's access logs (and the tests' fault proxy) can tell items apart.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym import destinations, framing, plain_http, reports
from nemo_gym_grpc.bridge.nemo_gym.replies import ReplyBudget
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.shared.contract import MiB

log = logging.getLogger(__name__)
# `plain_http.Response.kept` holds the failure report header under its lowercase name.
REPORT_HEADER_KEY = reports.HEADER.lower()

LIVENESS_PATH = "/"
REQUEST_ID_HEADER = "X-Request-Id"

# Longest X-Request-Id value sent, characters (uvicorn refuses very large header blocks).
_MAX_REQUEST_ID_HEADER = 200
# Largest reply body read from a NeMo Gym server by default, bytes (`--max-reply-mb`).
DEFAULT_MAX_REPLY_BYTES = 64 * MiB
# Reply bodies read at once by default, bytes (`--max-replies-mb`): 16 of the largest.
DEFAULT_MAX_REPLIES_BYTES = 1024 * MiB


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
    """An upstream's answer to one POST: HTTP status, body, the values of its `Set-Cookie`
    headers, the seconds from sending the request to reading the whole body, its failure
    report header (`reports.bounded`; "" without one) and its `Location` header ("" without
    one; redirects are not followed, a 3xx's error names it)."""

    status: int
    body: bytes
    set_cookies: list[str]
    seconds: float
    failure_report: str = ""
    location: str = ""


class Client:
    """The bridge's client for upstream POSTs (see the module docstring).

    Args:
        session: the aiohttp session; it must keep no cookies (`aiohttp.DummyCookieJar()`:
            NeMo Gym sets a session cookie on every reply, and a shared jar would send one
            item's session with another's call). It also serves the bridge's GETs.
        builtin: carry POSTs to `http://` URLs over `plain_http` (False: aiohttp for all).
        max_reply_bytes: most bytes of a reply body, as sent and as decompressed; a larger
            reply is not read further and its item fails (`post`).
        policy: the addresses `plain` may connect to (the session applies its own: built by
            `rpc.server` with the same policy).
        max_replies_bytes: most bytes of reply bodies being read at once, by both clients
            (`replies.ReplyBudget`: a reply waits for room before its body is read).

    Attributes:
        session: that session.
        plain: the `plain_http` client, None when not `builtin`.
        max_reply_bytes: that limit.
        replies: the budget of reply bytes.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        builtin: bool = True,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        policy: destinations.Policy | None = None,
        max_replies_bytes: int = DEFAULT_MAX_REPLIES_BYTES,
    ) -> None:
        self.session = session
        self.max_reply_bytes = max_reply_bytes
        self.replies = ReplyBudget(max_replies_bytes)
        keep = (reports.HEADER, "Location")
        plain = plain_http.Client(max_reply_bytes, keep, policy, self.replies) if builtin else None
        self.plain = plain

    async def aclose(self) -> None:
        """Close the `plain_http` connections (the session is its owner's to close)."""
        if self.plain is not None:
            await self.plain.close()


class Refused(errors.ItemError):
    """UNAVAILABLE / UPSTREAM_UNAVAILABLE because the upstream refused the connection (the
    caller may pass that replica over for a while)."""


async def post(
    client: Client,
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
        errors.ItemError: its `latency_seconds` the time spent. DEADLINE_EXCEEDED /
            UPSTREAM_TIMEOUT when `timeout` passed; UNAVAILABLE / UPSTREAM_UNAVAILABLE for a
            transport failure (`Refused` when the connection was refused: nothing was sent);
            FAILED_PRECONDITION / UPSTREAM_ADDRESS_REFUSED for an address `destinations`
            refuses (nothing was sent); INTERNAL / UPSTREAM_BAD_REPLY (not retried) for a
            reply that is not HTTP/1.1 within `framing`'s limits; FAILED_PRECONDITION /
            UPSTREAM_REPLY_TOO_LARGE (not retried; the connection is closed) for a body over
            `client.max_reply_bytes`.
    """
    header = request_id_header(request_id)
    headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: header}
    if cookie:
        headers["Cookie"] = cookie
    started = time.monotonic()
    plain = client.plain
    try:
        if plain is not None and url.startswith("http://"):
            reply = _reply(await plain.post(url, body, headers.items(), timeout), started)
        else:
            reply = await _aiohttp_post(client, url, body, headers, timeout, started)
    except (asyncio.TimeoutError, TimeoutError):
        error = _timed_out(url, timeout, queued)
    except framing.TooLarge as exc:
        error = _too_large(url, client.max_reply_bytes, exc)
    except (destinations.Denied, aiohttp.ClientConnectorError) as exc:
        error = _denied_or_unreachable(url, exc)
    except (framing.BadReply, aiohttp.ClientResponseError) as exc:  # aiohttp's parser: 400
        error = _bad_framing(url, exc)
    except (aiohttp.ClientError, plain_http.ConnectFailed, plain_http.Dropped) as exc:
        error = _unreachable(url, exc)
    else:
        log.debug("%s: HTTP %d, %.3f s, request_id=%s", url, reply.status, reply.seconds, header)
        return reply
    error.latency_seconds = time.monotonic() - started
    try:
        raise error
    finally:
        del error  # errors.py: no reference cycle through this frame


def _reply(got: plain_http.Response, started: float) -> Reply:
    """The Reply of a `plain_http` response to a request sent at `started` (monotonic)."""
    report = reports.bounded(got.kept.get(REPORT_HEADER_KEY))
    seconds = time.monotonic() - started
    return Reply(
        got.status, got.body, got.set_cookies, seconds, report, got.kept.get("location", "")
    )


async def _aiohttp_post(
    client: Client,
    url: str,
    body: bytes,
    headers: dict[str, str],
    timeout: float,
    started: float,
) -> Reply:
    async with client.session.post(
        url, data=body, headers=headers, timeout=exact_timeout(timeout), allow_redirects=False
    ) as reply:
        wait = timeout - (time.monotonic() - started)  # aiohttp's timer cancels only its own
        raw = await read_capped(reply, client.max_reply_bytes, client.replies, wait)
        seconds = time.monotonic() - started
        report = reports.bounded(reply.headers.get(reports.HEADER))
        cookies = reply.headers.getall("Set-Cookie", [])
        where = reply.headers.get("Location", "")
        return Reply(reply.status, raw, cookies, seconds, report, where)


async def read_capped(
    reply: aiohttp.ClientResponse,
    limit: int,
    replies: ReplyBudget | None = None,
    wait: float = math.inf,
) -> bytes:
    """The body of `reply` (decompressed by aiohttp, in bounded pieces), at most `limit` bytes
    by its Content-Length and by what was read; read once its bytes are reserved in `replies`
    (its Content-Length, or `limit` when it is compressed or has none), given back at the end.

    Raises:
        framing.TooLarge: over `limit`; the connection is closed.
        TimeoutError: the bytes were not free within `wait` seconds.
    """
    size = reply.content_length
    if size is not None and size > limit:
        reply.close()
        raise framing.TooLarge(f"Content-Length {size} is over {limit}")
    if replies is None:
        return await _read_upto(reply, limit)
    known = size is not None and "Content-Encoding" not in reply.headers
    reservation = replies.reserve(size if known and size is not None else limit)
    try:
        if not reservation.held:
            held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            reservation.when_held(functools.partial(_settle, held))
            await asyncio.wait_for(held, None if wait == math.inf else max(wait, 0.0))
        return await _read_upto(reply, limit)
    finally:
        reservation.release()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():  # not cancelled meanwhile
        future.set_result(None)


async def _read_upto(reply: aiohttp.ClientResponse, limit: int) -> bytes:
    pieces, size = [], 0
    async for piece in reply.content.iter_any():
        size += len(piece)
        if size > limit:
            reply.close()
            raise framing.TooLarge(f"more than {limit} body bytes came (decompressed)")
        pieces.append(piece)
    return b"".join(pieces)


def _too_large(url: str, limit: int, exc: framing.TooLarge) -> errors.ItemError:
    return errors.ItemError(
        code_pb2.FAILED_PRECONDITION,
        reasons.UPSTREAM_REPLY_TOO_LARGE,
        f"{url} replied with a body over the bridge's --max-reply-mb {limit / MiB:g} MiB "
        f"({exc}); raise the limit if such replies are expected",
        upstreamUrl=url,
        limitBytes=str(limit),
    )


def _timed_out(url: str, timeout: float, queued: float) -> errors.ItemError:
    return errors.ItemError(
        code_pb2.DEADLINE_EXCEEDED,
        reasons.UPSTREAM_TIMEOUT,
        f"{url} did not answer within {timeout:.3f} s",
        upstreamUrl=url,
        timeoutSeconds=f"{timeout:.3f}",
        queuedSeconds=f"{queued:.3f}",
    )


def _unreachable(url: str, exc: Exception) -> errors.ItemError:
    refused = isinstance(exc, (aiohttp.ClientConnectorError, plain_http.ConnectFailed))
    kind = Refused if refused else errors.ItemError
    return kind(
        code_pb2.UNAVAILABLE,
        reasons.UPSTREAM_UNAVAILABLE,
        f"{url} unreachable: {type(exc).__name__}: {errors.upstream_text(str(exc))}",
        upstreamUrl=url,
    )


def _denied_or_unreachable(url: str, exc: Exception) -> errors.ItemError:
    """FAILED_PRECONDITION / UPSTREAM_ADDRESS_REFUSED for an address the policy refuses (a
    `destinations.Denied`, raised or inside aiohttp's resolver error); else `_unreachable`."""
    denied = exc if isinstance(exc, destinations.Denied) else getattr(exc, "os_error", None)
    if not isinstance(denied, destinations.Denied):
        return _unreachable(url, exc)
    return errors.ItemError(
        code_pb2.FAILED_PRECONDITION,
        reasons.UPSTREAM_ADDRESS_REFUSED,
        f"{url} is not dialed: {denied}",
        upstreamUrl=url,
        why=str(denied),
    )


def _bad_framing(url: str, exc: Exception) -> errors.ItemError:
    """A reply that is not HTTP/1.1 within `framing`'s limits: not retried (the upstream
    answered; it would answer the same)."""
    why = exc.message if isinstance(exc, aiohttp.ClientResponseError) else str(exc)
    return errors.ItemError(
        code_pb2.INTERNAL,
        reasons.UPSTREAM_BAD_REPLY,
        f"{url} sent a reply that is not HTTP/1.1 the bridge reads: {errors.upstream_text(why)}",
        upstreamUrl=url,
    )


async def answers(session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
    """True when the resources server at base URL `url` answers its liveness route `GET /`
    with 200 within `timeout` seconds (a redirect is no answer: it is not followed)."""
    liveness = f"{url}{LIVENESS_PATH}"
    try:
        async with session.get(
            liveness, timeout=exact_timeout(timeout), allow_redirects=False
        ) as reply:
            return reply.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
