"""A small HTTP/1.1 client for the bridge's POSTs to plain-HTTP (`http://`) upstreams, on
httptools (llhttp, the parser of aiohttp's C extension and of uvicorn); aiohttp stays for
`https://` upstreams and every other call (probes, discovery, capabilities).

Why it exists (docs/performance.md): per request it spends a fraction of aiohttp's CPU, and a
cancelled request is closed at once, which NeMo Gym 0.7 turns into a cancelled handler
upstream. What it does, and nothing more: `POST` of a body of bytes with a fixed header set,
one request at a time per connection (no pipelining), a keep-alive pool per host:port with no
size limit (the bridge's slots bound the calls), Content-Length, chunked and close-delimited
replies, gzip / deflate bodies (decoded as aiohttp does), 1xx replies skipped, a cap on a
body's bytes as sent and as decoded (`Client(max_body=)`), each body read only once its bytes
are reserved (`Client(replies=)`; until then its connection is not read). No redirects, no
cookie jar, no proxies, no TLS.

Errors say what reached the upstream: `ConnectFailed` (nothing was sent: refused or
unreachable), `destinations.Denied` (nothing was sent: the address policy refuses it),
`Dropped` (the request was written, at least in part, then the connection closed or broke
before the whole reply came), `BadReply` (the reply is not HTTP/1.1 the parser
accepts, or its head breaks a limit of `framing`; `TooLarge`: its body is over the cap),
`TimeoutError` (the request's whole time passed). A request whose task is cancelled, or that
times out or fails, closes its connection; only a connection whose reply was read whole and
that both sides keep alive goes back to the pool.
"""

from __future__ import annotations

import asyncio
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import httptools

from nemo_gym_grpc.bridge.nemo_gym.destinations import Denied, Policy
from nemo_gym_grpc.bridge.nemo_gym.framing import (
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_LINE_BYTES,
    BadReply,
    TooLarge,
    decode_body,
    request_head,
    split_url,
)
from nemo_gym_grpc.bridge.nemo_gym.replies import ReplyBudget, Reservation

# Seconds an idle connection is kept (NeMo Gym's uvicorn closes them after 30 s; reusing one
# just as the server closes it costs a failed attempt).
KEEPALIVE_TIMEOUT = 15.0


class ConnectFailed(ConnectionError):
    """The connection could not be made (refused, unreachable): nothing of the request was
    sent. (A connect that runs out of the request's time is a TimeoutError, as in aiohttp.)"""


class Dropped(ConnectionError):
    """The request was sent (at least in part), then the connection closed or broke before the
    whole reply arrived: the upstream may have acted on it."""


@dataclass(slots=True)
class Response:
    """A whole reply: HTTP status, body (decoded when it was gzip / deflate), the values of
    its `Set-Cookie` headers, in order, and of the headers its client keeps (`Client(keep=)`,
    by lowercase name; the last one wins)."""

    status: int
    body: bytes
    set_cookies: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


class _Connection(asyncio.Protocol):
    """One TCP connection and the reply being read on it (httptools' callbacks). Its parser,
    which holds it, lives only while it is connected (no cycle left behind: errors.py)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        keep: frozenset[bytes],
        max_body: int,
        replies: ReplyBudget | None,
    ) -> None:
        self._loop = loop
        self._keep = keep
        self._max_body = max_body
        self._replies = replies
        self.reservation: Reservation | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Response] | None = None
        self.closed, self.idle_since = False, 0.0
        self._reset()

    def _reset(self) -> None:
        self._status = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._cookies: list[str] = []
        self._kept: dict[str, str] = {}
        self._framed = False  # Content-Length or chunked: the end is not the connection's
        self._length = -1  # the Content-Length, -1 without one
        self._encoding = b""
        self._head_bytes = 0
        self._headers = 0
        self._headers_done = False
        self.reusable = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._parser = httptools.HttpResponseParser(self)

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # not after connection_lost
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadReply(f"bad HTTP reply: {exc}"))
            return
        if not self._headers_done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(BadReply(f"reply head over {MAX_HEAD_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self._parser = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self._headers_done and not self._framed and self._status:
            self._complete(keep_alive=False)  # a close-delimited body ends here
            return
        cause = f": {exc}" if exc else ""
        waiter.set_exception(Dropped(f"connection closed before the whole reply came{cause}"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.waiter is None or self.waiter.done():  # nothing was asked: not ours to keep
            self._fail(BadReply("the upstream sent a reply nobody asked for"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        if len(name) + len(value) + 2 > MAX_LINE_BYTES or self._headers > MAX_HEADERS:
            limits = f"{MAX_LINE_BYTES} bytes a line, {MAX_HEADERS} lines"
            self._fail(BadReply(f"reply headers over the limits ({limits})"))
            return
        lowered = name.lower()
        if lowered == b"set-cookie":
            self._cookies.append(value.decode("latin-1"))
        elif lowered == b"content-length":
            self._framed = True
            if value.isdigit():
                self._length = int(value)
                if self._length > self._max_body:
                    self._fail(TooLarge(f"Content-Length {self._length} is over {self._max_body}"))
        elif lowered == b"transfer-encoding" and b"chunked" in value.lower():
            self._framed = True
        elif lowered == b"content-encoding":
            self._encoding = value.lower()
        elif lowered in self._keep:
            self._kept[lowered.decode("latin-1")] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self._parser is not None  # the parser calls this
        status = self._parser.get_status_code()
        self._headers_done = True
        if status < 200 or status in (204, 304):  # no body follows these
            self._framed = True
        elif self._replies is not None and self.reservation is None:
            self._reserve(self._replies)
        self._status = status

    def _reserve(self, replies: ReplyBudget) -> None:
        """Reserve the body's bytes: its Content-Length, or the cap when it is not known or
        may inflate; read no further until they are held."""
        known = self._length >= 0 and not self._encoding
        self.reservation = replies.reserve(self._length if known else self._max_body)
        if not self.reservation.held and self.transport is not None:
            self.transport.pause_reading()
            self.reservation.when_held(self._resume)

    def _resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def release(self) -> None:
        """Give back the reply's reserved bytes (or leave the queue for them)."""
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._max_body:
            self._fail(TooLarge(f"more than {self._max_body} body bytes came"))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if 100 <= self._status < 200:  # an interim reply (103 Early Hints): the real one follows
            self._reset()
            return
        assert self._parser is not None  # the parser calls this
        self._complete(self._parser.should_keep_alive())

    # the request side
    def _complete(self, keep_alive: bool) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        body = b"".join(self._body)
        self._body = []  # an idle pooled connection must not keep its last reply's pieces
        if self._encoding:
            try:
                body = decode_body(body, self._encoding, self._max_body)
            except TooLarge as exc:
                self._fail(exc)
                return
            except (zlib.error, BadReply) as exc:
                self._fail(BadReply(f"reply body does not decode as {self._encoding!r}: {exc}"))
                return
        self.reusable = keep_alive
        waiter.set_result(Response(self._status, body, self._cookies, self._kept))

    def _fail(self, exc: Exception) -> None:
        self.reusable = False
        self._body = []
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.abort()

    def abort(self) -> None:
        """Close the connection at once (RST when data is unread)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def send(self, head: bytes, body: bytes) -> asyncio.Future[Response]:
        """Write one request; the future gets its whole reply."""
        self._reset()
        self.waiter = self._loop.create_future()
        assert self.transport is not None
        self.transport.writelines((head, body))
        return self.waiter

    def timed_out(self) -> None:
        self._fail(TimeoutError())


class Client:
    """POSTs over kept-alive HTTP/1.1 connections, one pool per host:port (see the module).

    Idle connections are closed after KEEPALIVE_TIMEOUT seconds.

    Args:
        keep: names of the reply headers (besides Set-Cookie) each `Response.kept` holds.
        max_body: most bytes of a reply's body, as sent and as decoded (`TooLarge` beyond).
        policy: the addresses it may connect to (`destinations.Denied` for others; default
            `Policy()`).
        replies: where each reply body reserves its bytes before it is read; None = nowhere.
    """

    def __init__(
        self,
        max_body: int,
        keep: Iterable[str] = (),
        policy: Policy | None = None,
        replies: ReplyBudget | None = None,
    ) -> None:
        self._policy = policy or Policy()
        self._replies = replies
        self._keepalive = KEEPALIVE_TIMEOUT
        self._max_body = max_body
        self._keep = frozenset(name.lower().encode("latin-1") for name in keep)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self.connections_made = 0

    async def post(
        self, url: str, body: bytes, headers: Iterable[tuple[str, str]], timeout: float
    ) -> Response:
        """`POST url` with `body` and `headers` (Host and Content-Length are added), its whole
        reply within `timeout` seconds (> 0; connecting included).

        Raises:
            ValueError: `url` is not http://, or a header holds CR, LF or NUL.
            ConnectFailed, Dropped, BadReply, TimeoutError: see the module docstring.
        """
        host, port, target, host_header = split_url(url)
        head = request_head(target, host_header, headers, len(body))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        connection = self._take(host, port, loop.time())
        if connection is None:
            connection = await self._connect(loop, host, port, deadline)
        self._busy.add(connection)
        timer = loop.call_at(deadline, connection.timed_out)
        try:
            response = await connection.send(head, body)
        except BaseException:  # cancelled, timed out or failed: the request ends here
            connection.abort()
            raise
        finally:
            timer.cancel()
            connection.release()
            self._busy.discard(connection)
        if connection.reusable and not connection.closed:
            self._put(host, port, connection, loop)
        else:
            connection.abort()
        return response

    def _take(self, host: str, port: int, now: float) -> _Connection | None:
        idle = self._idle.get((host, port))
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self._keepalive:
                return connection
            connection.abort()
        return None

    def _put(
        self, host: str, port: int, connection: _Connection, loop: asyncio.AbstractEventLoop
    ) -> None:
        connection.idle_since = loop.time()
        connection.waiter = None
        self._idle.setdefault((host, port), []).append(connection)
        if self._sweeper is None:
            self._sweeper = loop.call_later(self._keepalive, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the connections idle for KEEPALIVE_TIMEOUT seconds (every so often)."""
        self._sweeper = None
        now = loop.time()
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if not c.closed and now - c.idle_since < self._keepalive]
            for connection in idle:
                if connection not in keep:
                    connection.abort()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        if self._idle:
            self._sweeper = loop.call_later(self._keepalive / 2, self._sweep, loop)

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int, deadline: float
    ) -> _Connection:
        opening = self._open(loop, host, port)
        try:
            if sys.version_info >= (3, 11):  # a timer, not wait_for's task per connection
                async with asyncio.timeout_at(deadline):
                    return await opening
            return await asyncio.wait_for(opening, max(deadline - loop.time(), 0.0))
        except (asyncio.TimeoutError, TimeoutError):
            raise TimeoutError(f"connect to {host}:{port} timed out") from None
        except Denied:
            raise
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from exc

    async def _open(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> _Connection:
        """A connection to the first of `host`'s allowed addresses that takes one."""
        addresses = await self._policy.addresses(host, port)
        for number, address in enumerate(addresses, 1):
            connection = _Connection(loop, self._keep, self._max_body, self._replies)
            try:
                await loop.create_connection(lambda: connection, address, port)  # noqa: B023
            except OSError:
                if number == len(addresses):
                    raise  # the last address's error (unbound: no cycle, errors.py)
                continue
            self.connections_made += 1
            return connection
        raise OSError(f"{host} has no address")

    def idle_connections(self) -> int:
        """Connections in the pool now, waiting for a request."""
        return sum(len(idle) for idle in self._idle.values())

    async def close(self) -> None:
        """Close every connection, idle and busy (the busy requests fail with `Dropped`)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in self._idle.values():
            for connection in idle:
                connection.abort()
        self._idle.clear()
        for connection in list(self._busy):
            connection.abort()
        await asyncio.sleep(0)  # let the transports run connection_lost
