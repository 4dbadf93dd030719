"""A property test (hypothesis) of `bridge.plain_http` against aiohttp (issue 22): for generated
HTTP/1.1 replies (any status, headers, Set-Cookie lines, body; Content-Length, chunked or
close-delimited; gzip / deflate; an interim 103 before; written in arbitrary pieces; cut short
or not), both clients read the same status, body and Set-Cookie values, or both fail.

The replies come from a raw asyncio server scripted per example: the point is to send bytes no
well-behaved server would, which a real NeMo Gym server cannot be made to.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_gym_grpc.bridge.nemo_gym import framing, plain_http

# The body cap of our client: far above any reply here.
MAX_BODY = 1 << 30
STATUSES = [200, 201, 204, 400, 404, 409, 422, 429, 500, 502, 503, 504]
TOKEN = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", min_size=1)
VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.strip)
# Replies neither client may read as a reply.
MALFORMED = [
    b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nabcde",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
]


@st.composite
def replies(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(the reply's bytes, whether the server closes after it)."""
    if draw(st.integers(0, 19)) == 0:
        return draw(st.sampled_from(MALFORMED)), True
    status = draw(st.sampled_from(STATUSES))
    body = b"" if status == 204 else draw(st.binary(max_size=3000))
    framing = "length" if status == 204 else draw(st.sampled_from(["length", "chunked", "close"]))
    headers = [(draw(TOKEN), draw(VALUE)) for _ in range(draw(st.integers(0, 3)))]
    headers = [(n, v) for n, v in headers if n.lower() not in _FRAMING_HEADERS]
    headers += [
        ("Set-Cookie", f"{draw(TOKEN)}={draw(TOKEN)}; Path=/")
        for _ in range(draw(st.integers(0, 3)))
    ]
    encoding = draw(st.sampled_from([None, "gzip", "deflate"])) if body else None
    if encoding == "gzip":
        body = gzip.compress(body)
    elif encoding == "deflate":
        body = zlib.compress(body)
    if encoding:
        headers.append(("Content-Encoding", encoding))
    close = framing == "close" or draw(st.booleans())
    if close:
        headers.append(("Connection", "close"))
    if framing == "length":
        headers.append(("Content-Length", str(len(body))))
        payload = body
    elif framing == "chunked":
        headers.append(("Transfer-Encoding", "chunked"))
        payload = _chunked(body, draw(st.integers(1, 1000)))
    else:
        payload = body
    head = f"HTTP/1.1 {status} {draw(st.sampled_from(['OK', 'Whatever', '']))}\r\n"
    head += "".join(f"{n}: {v}\r\n" for n, v in headers) + "\r\n"
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" if draw(st.booleans()) else b""
    raw = interim + head.encode() + payload
    if draw(st.integers(0, 9)) == 0:  # cut short, then closed
        return raw[: draw(st.integers(0, len(raw) - 1))], True
    return raw, close


_FRAMING_HEADERS = {"content-length", "transfer-encoding", "content-encoding", "connection"}


def _chunked(body: bytes, size: int) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


class Scripted:
    """Answers each request on a connection with `reply`, written in `pieces`."""

    def __init__(self, reply: bytes, close: bool, pieces: list[int]) -> None:
        self.reply, self.close, self.pieces = reply, close, sorted(set(pieces))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                start = 0
                for cut in [p for p in self.pieces if 0 < p < len(self.reply)] + [len(self.reply)]:
                    writer.write(self.reply[start:cut])
                    await writer.drain()
                    await asyncio.sleep(0)
                    start = cut
                if self.close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _both(script: Scripted) -> tuple[object, object]:
    server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/verify"
    ours = plain_http.Client(MAX_BODY)
    session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
    try:
        got = []
        for _ in range(2):  # twice: the second may reuse the kept-alive connection
            got.append(await _plain(ours, url))
            got.append(await _aiohttp(session, url))
        return (got[0], got[2]), (got[1], got[3])
    finally:
        await ours.close()
        await session.close()
        server.close()


async def _plain(client: plain_http.Client, url: str) -> object:
    try:
        reply = await client.post(url, b"{}", [("Content-Type", "application/json")], 5.0)
    except (plain_http.Dropped, framing.BadReply):
        return "failed"
    return reply.status, reply.body, reply.set_cookies


async def _aiohttp(session: aiohttp.ClientSession, url: str) -> object:
    try:
        async with session.post(url, data=b"{}", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status, await r.read(), r.headers.getall("Set-Cookie", [])
    except (aiohttp.ClientResponseError, aiohttp.ClientPayloadError, aiohttp.ClientOSError):
        return "failed"
    except aiohttp.ServerDisconnectedError:
        return "failed"
    except TimeoutError:
        # aiohttp 3.14.5 never reports some framing errors: a chunked reply whose chunk size is
        # "zz", its first byte sent alone, then its head, then its body, waits for the whole
        # timeout (measured; the same bytes in other pieces fail at once). A failure still.
        return "failed"


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(reply=replies(), pieces=st.lists(st.integers(0, 4000), max_size=6))
def test_both_clients_read_every_reply_alike(reply: tuple[bytes, bool], pieces: list[int]) -> None:
    ours, theirs = asyncio.run(_both(Scripted(reply[0], reply[1], pieces)))
    assert ours == theirs
