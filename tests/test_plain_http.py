"""The fault matrix for the bridge's two HTTP clients (issue 22): `bridge.plain_http` (ours, for
http:// upstreams) and aiohttp, through the same faults of tests/support/fault_proxy.py
(refused, dropped, reset, cut and stalled bodies, slow and chunked bodies, cancel, keep-alive
reuse after errors and after the server closed idle connections). Each fault must end the same
way for both ("the same outcome"), and for ours the connection count shows what was reused.

The upstream is a FaultProxy with no upstream of its own that answers every POST with a fixed
JSON body (a scripted stand-in: a fault on demand is what a real NeMo Gym server cannot give),
behind a second FaultProxy that injects the fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator

import aiohttp
import pytest

from nemo_gym_grpc.bridge.nemo_gym import framing, plain_http
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.waiting import until

REPLY = b'{"reward": 1.0, "text": "' + b"x" * 5000 + b'"}'
HEADERS = [("Content-Type", "application/json"), ("X-Request-Id", "item-1")]
CLIENTS = ["plain", "aiohttp"]
# The body cap of the clients under test: far above any reply here.
MAX_BODY = 1 << 30


@pytest.fixture(scope="module")
def proxy() -> Iterator[FaultProxy]:
    with FaultProxy(None) as upstream:
        upstream.set_faults(Fault("status", status=200, body=REPLY))
        with FaultProxy(upstream.url) as front:
            yield front


class Either:
    """One of the two clients behind one call: `post` returns (status, body) or raises
    `Outcome` naming what happened."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.plain = plain_http.Client(MAX_BODY)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar()
        )

    async def post(self, url: str, timeout: float = 5.0) -> tuple[int, bytes]:
        if self.kind == "plain":
            try:
                reply = await self.plain.post(url, b"{}", HEADERS, timeout)
            except plain_http.ConnectFailed:
                raise Outcome("refused") from None
            except plain_http.Dropped:
                raise Outcome("dropped") from None
            except framing.BadReply:
                raise Outcome("bad") from None
            except TimeoutError:
                raise Outcome("timeout") from None
            return reply.status, reply.body
        try:
            limit = aiohttp.ClientTimeout(total=timeout)
            async with self.session.post(
                url, data=b"{}", headers=dict(HEADERS), timeout=limit
            ) as r:
                return r.status, await r.read()
        except aiohttp.ClientConnectorError:
            raise Outcome("refused") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError):
            raise Outcome("dropped") from None
        except aiohttp.ClientResponseError:
            raise Outcome("bad") from None
        except TimeoutError:
            raise Outcome("timeout") from None

    async def close(self) -> None:
        await self.plain.close()
        await self.session.close()


class Outcome(Exception):
    """What a failed POST came to: refused, dropped, bad or timeout."""


@pytest.fixture(params=CLIENTS)
async def client(request: pytest.FixtureRequest):
    either = Either(request.param)
    yield either
    await either.close()


async def outcome(client: Either, url: str, timeout: float = 5.0) -> str:
    try:
        status, body = await client.post(url, timeout)
    except Outcome as exc:
        return str(exc)
    assert body == REPLY or status != 200
    return str(status)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (None, "200"),
        (Fault("status", status=503, body=b'"busy"'), "503"),
        (Fault("drop"), "dropped"),
        (Fault("reset"), "dropped"),
        (Fault("cut_body"), "dropped"),
        (Fault("trickle", pieces=5, pace=0.05), "200"),
        (Fault("chunked", pieces=7), "200"),
        (Fault("chunked", pieces=3, pace=0.05), "200"),
        (Fault("stall_body"), "timeout"),
        (Fault("hang"), "timeout"),
        (Fault("trickle", pieces=10, pace=0.2), "timeout"),
    ],
    ids=lambda v: getattr(v, "action", v),
)
async def test_each_fault_ends_the_same_way_and_the_next_request_succeeds(
    client: Either, proxy: FaultProxy, fault: Fault | None, expected: str
) -> None:
    proxy.set_faults(*([fault] if fault else []))
    # A fault that must time out gets a short timeout; one that must not, a long one.
    timeout = 0.3 if expected == "timeout" else 5.0
    assert await outcome(client, proxy.url + "/verify", timeout) == expected
    # Whatever the last request left behind, the next one gets the upstream's reply, and a
    # request cut short left nothing running upstream.
    proxy.set_faults()
    assert await outcome(client, proxy.url + "/verify") == "200"
    await until(lambda: proxy.in_flight == 0, 3, "no request in flight")


async def test_a_refused_connection_is_told_from_a_dropped_request(client: Either) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert await outcome(client, f"http://127.0.0.1:{port}/verify") == "refused"


async def test_cancelling_a_request_closes_its_connection_at_once(
    client: Either, proxy: FaultProxy
) -> None:
    proxy.set_faults(Fault("hang"))
    task = asyncio.ensure_future(client.post(proxy.url + "/verify", timeout=30.0))
    await until(lambda: proxy.in_flight == 1, 3, "the request in flight")
    cancelled = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The proxy's handler ends when the client's connection does.
    await until(lambda: proxy.in_flight == 0, 1.0, "the request's end upstream")
    assert time.monotonic() - cancelled < 1.0


async def test_keep_alive_connections_are_reused_after_http_errors_not_after_broken_replies(
    proxy: FaultProxy,
) -> None:
    client = plain_http.Client(MAX_BODY)
    url = proxy.url + "/verify"
    try:
        proxy.set_faults(Fault("status", status=500, body=b'"no"', times=3))
        for _ in range(6):
            await client.post(url, b"{}", HEADERS, 5.0)
        assert client.connections_made == 1  # three 500s and three 200s on one connection
        proxy.set_faults(Fault("cut_body", times=1))
        with pytest.raises(plain_http.Dropped):
            await client.post(url, b"{}", HEADERS, 5.0)
        reply = await client.post(url, b"{}", HEADERS, 5.0)
        assert (reply.status, reply.body) == (200, REPLY)
        assert client.connections_made == 2  # the broken one was not reused
    finally:
        await client.close()


async def test_a_pooled_connection_keeps_nothing_of_its_last_reply(proxy: FaultProxy) -> None:
    """The reply's body is the caller's alone: 64 idle connections that each kept their
    last 48 MiB reply held 2.5 GB after the replies were scored (benchmarks/memory.py)."""
    proxy.set_faults()
    client = plain_http.Client(MAX_BODY)
    try:
        reply = await client.post(proxy.url + "/verify", b"{}", HEADERS, 5.0)
        assert reply.body == REPLY and client.idle_connections() == 1
        ((idle,),) = client._idle.values()
        assert idle._body == []
    finally:
        await client.close()


async def test_connections_the_server_closed_while_idle_are_not_reused(
    client: Either, proxy: FaultProxy
) -> None:
    proxy.set_faults()
    url = proxy.url + "/verify"
    assert await outcome(client, url) == "200"
    proxy.restart()  # closes every open connection, the idle one included
    await asyncio.sleep(0.1)
    assert await outcome(client, url) == "200"


async def test_concurrent_requests_each_get_their_own_reply(proxy: FaultProxy) -> None:
    proxy.set_faults()
    client = plain_http.Client(MAX_BODY)
    try:
        replies = await asyncio.gather(
            *(client.post(proxy.url + "/verify", b"{}", HEADERS, 10.0) for _ in range(200))
        )
        assert {(r.status, r.body) for r in replies} == {(200, REPLY)}
        assert client.connections_made <= 200
        assert client.idle_connections() == client.connections_made
    finally:
        await client.close()


def test_header_injection_is_refused() -> None:
    with pytest.raises(ValueError, match="CR, LF"):
        framing.request_head(b"/verify", b"h", [("Cookie", "a=b\r\nX-Evil: 1")], 2)
    with pytest.raises(ValueError, match="plain-HTTP"):
        framing.split_url("https://example.invalid/verify")


async def test_a_large_body_is_read_whole_and_an_endless_head_is_refused() -> None:
    big = b"x" * 3_000_000

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while head := await reader.readuntil(b"\r\n\r\n"):  # one connection, reused
                await reader.readexactly(2)
                if b"/big" in head:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
                else:
                    filler = b"y" * (framing.MAX_HEAD_BYTES + 1000)  # one line, never ended
                    writer.write(b"HTTP/1.1 200 OK\r\nX-Filler: " + filler)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = plain_http.Client(MAX_BODY)
    try:
        reply = await client.post(base + "/big", b"{}", HEADERS, 10.0)
        assert (reply.status, len(reply.body)) == (200, len(big))
        with pytest.raises(framing.BadReply, match="head over"):
            await client.post(base + "/endless", b"{}", HEADERS, 10.0)
    finally:
        await client.close()
        server.close()
