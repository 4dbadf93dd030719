"""The bytes of NeMo Gym reply bodies read at once are bounded (`--max-replies-mb`,
`bridge/nemo_gym/replies.py`): a reply reserves its size before its body is read, waits without
holding anything while it does not fit, and gives it back when its call ends, with both of the
bridge's HTTP clients.

The upstream is a scripted aiohttp server on loopback (a stand-in: no NeMo Gym server stalls
a reply half-way on demand); the clients are the bridge's own, over real HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym import http
from nemo_gym_grpc.bridge.nemo_gym.replies import ReplyBudget
from tests.support.waiting import until

MiB = 1 << 20
BODY = 4 * MiB  # far more than one socket read, so a reply that waits is not read whole
MAX_REPLY = 8 * MiB


def test_reservations_are_all_or_nothing_and_taken_in_order():
    budget = ReplyBudget(10)
    first, second, third = budget.reserve(6), budget.reserve(6), budget.reserve(2)
    assert (first.held, second.held, third.held) == (True, False, False)  # third: in line
    assert (budget.held, budget.waiting) == (6, 2)
    taken: list[str] = []
    second.when_held(lambda: taken.append("second"))
    third.when_held(lambda: taken.append("third"))
    first.release()
    assert taken == ["second", "third"] and budget.held == 8
    second.release()
    third.release()
    third.release()  # twice: nothing more
    assert (budget.held, budget.waiting) == (0, 0)


def test_a_waiting_reservation_that_ends_lets_the_next_in():
    budget = ReplyBudget(10)
    held, big, small = budget.reserve(4), budget.reserve(8), budget.reserve(6)
    big.release()  # its call ended while it waited
    assert small.held and not big.held and budget.held == 10 and budget.waiting == 0
    held.release()
    small.release()
    assert budget.held == 0


def test_a_reply_larger_than_the_whole_budget_is_read_alone():
    budget = ReplyBudget(10)
    huge = budget.reserve(50)
    assert huge.held and budget.reserve(1).held is False
    huge.release()
    assert budget.held == 1


class Upstream:
    """`POST /stalled`: Content-Length BODY, a quarter of it, then the rest once `go` is set;
    `/chunked`: the same without a Content-Length; `/whole`: BODY at once."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def stalled(self, request: web.Request) -> web.StreamResponse:
        return await self._send(request, chunked=False)

    async def chunked(self, request: web.Request) -> web.StreamResponse:
        return await self._send(request, chunked=True)

    async def _send(self, request: web.Request, chunked: bool) -> web.StreamResponse:
        response = web.StreamResponse()
        if chunked:
            response.enable_chunked_encoding()
        else:
            response.content_length = BODY
        await response.prepare(request)
        await response.write(b"x" * (BODY // 4))
        await self.go.wait()
        await response.write(b"x" * (BODY - BODY // 4))
        await response.write_eof()
        return response

    async def whole(self, _request: web.Request) -> web.Response:
        return web.Response(body=b"y" * BODY)


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, str]]:
    scripted = Upstream()
    app = web.Application()
    app.router.add_post("/stalled", scripted.stalled)
    app.router.add_post("/chunked", scripted.chunked)
    app.router.add_post("/whole", scripted.whole)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield scripted, f"http://127.0.0.1:{port}"
    scripted.go.set()
    await runner.cleanup()


@pytest.fixture(params=["builtin", "aiohttp"])
async def client(request) -> AsyncIterator[http.Client]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        client = http.Client(
            session,
            builtin=request.param == "builtin",
            max_reply_bytes=MAX_REPLY,
            max_replies_bytes=BODY + BODY // 2,
        )
        yield client
        await client.aclose()


async def post(client: http.Client, url: str, timeout: float = 10.0) -> http.Reply:
    return await http.post(client, url, b"{}", timeout=timeout, request_id="r")


async def test_a_reply_that_does_not_fit_waits_until_another_is_read(client, upstream):
    scripted, base = upstream
    budget = client.replies
    first = asyncio.create_task(post(client, f"{base}/stalled"))
    await until(lambda: budget.held == BODY, 5, "the first reply holds its Content-Length")
    second = asyncio.create_task(post(client, f"{base}/whole"))
    await until(lambda: budget.waiting == 1, 5, "the second reply waits")
    await asyncio.sleep(0.2)
    assert not second.done() and budget.held == BODY
    scripted.go.set()
    replies = await asyncio.gather(first, second)
    assert [len(reply.body) for reply in replies] == [BODY, BODY]
    assert (budget.held, budget.waiting) == (0, 0)


async def test_a_reply_that_waits_past_its_timeout_fails_and_leaves_the_line(client, upstream):
    scripted, base = upstream
    budget = client.replies
    first = asyncio.create_task(post(client, f"{base}/stalled"))
    await until(lambda: budget.held == BODY, 5, "the first reply holds its Content-Length")
    with pytest.raises(errors.ItemError) as failed:
        await post(client, f"{base}/whole", timeout=0.3)
    assert failed.value.code == code_pb2.DEADLINE_EXCEEDED
    assert (budget.held, budget.waiting) == (BODY, 0)
    scripted.go.set()
    await first
    assert budget.held == 0


async def test_a_reply_of_unknown_size_reserves_the_largest_reply(client, upstream):
    scripted, base = upstream
    client.replies.limit = 2 * MAX_REPLY
    reading = asyncio.create_task(post(client, f"{base}/chunked"))
    await until(lambda: client.replies.held == MAX_REPLY, 5, "the chunked reply holds the cap")
    scripted.go.set()
    assert len((await reading).body) == BODY
    assert client.replies.held == 0
