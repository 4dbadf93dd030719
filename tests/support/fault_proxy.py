"""A fault-injecting HTTP proxy for NeMo Gym `/verify` calls, run in a background thread.

    with FaultProxy("http://127.0.0.1:18001") as proxy:     # in front of a real server
        proxy.set_faults(Fault("status", status=503, times=1))
        ... point the bridge at proxy.url ...
        proxy.in_flight, proxy.attempts["item-7"]

With `upstream=None` it is a scripted upstream: requests no fault matches get HTTP 502.

A fault applies to requests whose body contains `match` (None = every request) and whose path
ends with `path` (None = any), to the first `times` of them (None = all). The first fault that
applies wins; others pass through. Actions:

    pass           forward to the upstream unchanged
    status         answer `status` with `body` (nothing forwarded)
    reply          forward, then answer the upstream's status with `body` instead of its own
    delay          forward (any action waits `seconds` first; default 0)
    hang           read the request, never answer (until the client goes away)
    drop           read the request, close the connection without a response
    stall_body     forward, send the reply's headers and half its body, then never finish
    cut_body       forward, send the reply's headers and half its body, then close
    reset          read the request, then reset the connection (TCP RST, no response)
    trickle        forward, send the reply's body in `pieces` parts, `pace` seconds apart
    chunked        forward, send the reply chunked (Transfer-Encoding), in `pieces` chunks

Counters: `in_flight` (requests being handled now; a client that disconnects ends its
request), `peak_in_flight`, `total`, `attempts[request_id]` (`/verify` requests, also under
NeMo Gym 0.7's `/ng-rollout/<id>` prefix, by their `X-Request-Id` header, which the bridge sets
to the item's request_id) and `posts[(path, request_id)]` (every POST by its full path).
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

_ROLLOUT_VERIFY = re.compile(r"^/ng-rollout/[^/]+/verify$")
# The upstream reply's Set-Cookie headers, stored on the proxied request.
_SET_COOKIE = web.RequestKey("set_cookie", list)


@dataclass
class Fault:
    """One scripted fault (see the module docstring for `action`).

    Attributes:
        action: what to do with a matching request.
        match: bytes (or str, UTF-8 encoded) the request body must contain; None = any.
        path: what the request's path must end with (e.g. "/verify"); None = any.
        times: apply to this many matching requests, then stop applying; None = always.
        status: HTTP status for `status` / `reply`.
        body: reply body for `status` / `reply`.
        seconds: wait this long before acting (a slow upstream).
        pieces: parts of the body for `trickle` and `chunked`.
        pace: seconds between those parts.
        headers: reply headers added to the answer of `pass`, `status`, `reply` and `delay`
            (what no real server sends yet, e.g. `X-NG-Failure-Report`).
        hits: how many requests this fault was applied to (counted by the proxy).
    """

    action: str
    match: bytes | str | None = None
    times: int | None = None
    status: int = 200
    body: bytes = b""
    seconds: float = 0.0
    pieces: int = 4
    pace: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    hits: int = 0
    path: str | None = None

    def applies(self, body: bytes, path: str = "") -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.path is not None and not path.endswith(self.path):
            return False
        needle = self.match.encode() if isinstance(self.match, str) else self.match
        return needle is None or needle in body


class FaultProxy:
    """The proxy (see module docstring). Listens on 127.0.0.1 on a free port (or `port`).

    Args:
        upstream: base URL requests are forwarded to (path kept), or None (scripted).
        port: port to listen on; 0 = a free one, kept across `restart()`.
    """

    def __init__(self, upstream: str | None, port: int = 0) -> None:
        self.upstream = upstream.rstrip("/") if upstream else None
        self.port = port
        self.faults: list[Fault] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.total = 0
        self.attempts: Counter[str] = Counter()
        self.posts: Counter[tuple[str, str]] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        """The proxy's base URL, e.g. http://127.0.0.1:40123."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> FaultProxy:
        """Start the thread and listen. Returns self."""
        self._thread.start()
        self._call(self._open_session())
        self._call(self._listen())
        return self

    def close(self) -> None:
        """Stop listening, close every connection and stop the thread."""
        self._call(self._stop_listening())
        if self._session:
            self._call(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def restart(self, downtime: float = 0.0) -> None:
        """Close the listener and every open connection (as a server restart does), stay
        down `downtime` seconds, then listen again on the same port."""
        self._call(self._stop_listening())
        self._call(asyncio.sleep(downtime))
        self._call(self._listen())

    def cut_connections(self) -> None:
        """Abort every open connection (requests in flight end without a reply) and keep
        listening: a server whose workers died and came back at once. (`restart` also closes
        the listener for a while, during which connections are refused.)"""
        self._call(self._cut())

    async def _cut(self) -> None:
        assert self._runner is not None and self._runner.server is not None
        for handler in list(self._runner.server.connections):
            if handler.transport is not None:
                handler.transport.abort()
        await asyncio.sleep(0)  # let the connections' handlers see it

    def set_faults(self, *faults: Fault) -> list[Fault]:
        """Replace the fault list and reset every counter. Returns the faults."""
        self.faults = list(faults)
        self.reset_counters()
        return self.faults

    def reset_counters(self) -> None:
        """Zero `total`, `peak_in_flight`, `attempts` and `posts` (not `in_flight`)."""
        self.total = 0
        self.peak_in_flight = self.in_flight
        self.attempts = Counter()
        self.posts = Counter()

    async def _open_session(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )

    async def _listen(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client that disconnects ends its handler (and in_flight);
        # a tiny shutdown_timeout: a restart cuts open requests as a crashed server would
        # (0 would mean "wait for them forever").
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.01
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _stop_listening(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _forward(self, request: web.Request, body: bytes) -> tuple[int, bytes, str]:
        if self.upstream is None:
            return 502, b'"no upstream and no fault for this request"', "application/json"
        # Session cookies pass both ways (NeMo Gym sessions work through the proxy).
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        if "Cookie" in request.headers:
            headers["Cookie"] = request.headers["Cookie"]
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            data=body,
            headers=headers,
        ) as reply:
            request[_SET_COOKIE] = reply.headers.getall("Set-Cookie", [])
            content_type = reply.headers.get("Content-Type", "application/json")
            return reply.status, await reply.read(), content_type

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method != "POST":  # readiness probes: pass through, not counted
            status, payload, content_type = await self._forward(request, body)
            return web.Response(
                status=status,
                body=payload,
                content_type=None,
                headers={"Content-Type": content_type},
            )
        self.total += 1
        request_id = request.headers.get("X-Request-Id", "")
        self.posts[(request.path, request_id)] += 1
        if request.path == "/verify" or _ROLLOUT_VERIFY.match(request.path):
            self.attempts[request_id] += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            fault = next((f for f in self.faults if f.applies(body, request.path)), None)
            if fault is not None:
                fault.hits += 1
            return await self._act(fault, request, body)
        finally:
            self.in_flight -= 1

    async def _act(self, fault: Fault | None, request: web.Request, body: bytes):
        action = fault.action if fault else "pass"
        if fault is not None and fault.seconds:
            await asyncio.sleep(fault.seconds)
        if action in ("hang", "drop", "reset"):
            if action == "reset" and request.transport is not None:
                sock = request.transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                request.transport.abort()
            if action == "drop":
                request.transport.close()
            await asyncio.Event().wait()  # ends when the connection does (cancellation)
        if action == "status":
            headers = {"Content-Type": "application/json", **fault.headers}
            return web.Response(status=fault.status, body=fault.body, headers=headers)
        status, payload, content_type = await self._forward(request, body)
        if action == "reply":
            payload = fault.body
        if action in ("stall_body", "cut_body"):
            response = web.StreamResponse(status=status)
            response.content_type = content_type
            response.content_length = len(payload)
            await response.prepare(request)
            await response.write(payload[: len(payload) // 2])
            if action == "cut_body":
                request.transport.close()
            await asyncio.Event().wait()
        headers = CIMultiDict({"Content-Type": content_type})
        for cookie in request.get(_SET_COOKIE, ()):
            headers.add("Set-Cookie", cookie)
        headers.update(fault.headers if fault is not None else {})
        if action in ("trickle", "chunked"):
            return await _in_pieces(request, status, headers, payload, fault)
        return web.Response(status=status, body=payload, headers=headers)


async def _in_pieces(request: web.Request, status: int, headers, payload: bytes, fault: Fault):
    """The reply's body in `fault.pieces` writes, `fault.pace` seconds apart: with a
    Content-Length (`trickle`) or chunked (`chunked`)."""
    response = web.StreamResponse(status=status, headers=headers)
    if fault.action == "chunked":
        response.enable_chunked_encoding()
    else:
        response.content_length = len(payload)
    await response.prepare(request)
    size = -(-len(payload) // max(fault.pieces, 1)) or 1
    for start in range(0, len(payload), size):
        if start and fault.pace:
            await asyncio.sleep(fault.pace)
        await response.write(payload[start : start + size])
    await response.write_eof()
    return response
