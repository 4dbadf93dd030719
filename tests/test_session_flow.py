"""The session flow (`bridge/flows/session.py`) in process, over real HTTP: each call sends the
session's latest cookies, a session idle past its lease is closed upstream once, and the table
is bounded.

The upstream is a scripted aiohttp server on loopback (a stand-in: the fast tier runs without
NeMo Gym; tests/test_session_service.py runs the same calls against real NeMo Gym servers). It
answers `/openapi.json` with 0.7's routes, so the bridge treats it as a 0.7 server that has
`/close_session`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows import session as session_flow
from nemo_gym_grpc.bridge.flows.balancer import Balancer
from nemo_gym_grpc.bridge.flows.session import Sessions
from nemo_gym_grpc.bridge.flows.session_checks import merged_cookies
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.nemo_gym import capabilities, http
from nemo_gym_grpc.bridge.process.metrics import Metrics
from nemo_gym_grpc.v1 import session_pb2

ROUTES = ["/seed_session", "/verify", "/close_session", "/step_counter"]


class Scripted:
    """Seeds set cookie `s=0`; each `/step_counter` sets `s=<n+1>` from the `s` it got."""

    def __init__(self) -> None:
        self.cookies: list[str] = []
        self.closed: list[dict] = []

    async def openapi(self, _request: web.Request) -> web.Response:
        paths = {route: {"post": {}} for route in ROUTES}
        return web.json_response({"paths": paths})

    async def seed(self, request: web.Request) -> web.Response:
        reply = web.json_response({})
        reply.set_cookie("s", "0")
        return reply

    async def step(self, request: web.Request) -> web.Response:
        self.cookies.append(request.headers.get("Cookie", ""))
        count = int(request.cookies.get("s", "-1")) + 1
        reply = web.json_response({"count": count})
        reply.set_cookie("s", str(count))
        return reply

    async def close(self, request: web.Request) -> web.Response:
        self.closed.append(await request.json())
        return web.json_response({})


@pytest.fixture
async def flow() -> AsyncIterator[tuple[Sessions, Scripted]]:
    scripted = Scripted()
    app = web.Application()
    app.router.add_get("/openapi.json", scripted.openapi)
    app.router.add_post("/seed_session", scripted.seed)
    app.router.add_post("/step_counter", scripted.step)
    app.router.add_post("/close_session", scripted.close)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        client = http.Client(session)
        sessions = Sessions(
            Upstreams({"s": url}),
            client,
            balancer=Balancer(16),
            catalog=capabilities.Catalog(session),
            metrics=Metrics(),
            default_timeout=5.0,
            max_item_bytes=1 << 20,
            lease=60.0,
            max_sessions=2,
        )
        yield sessions, scripted
        await sessions.aclose()
        await client.aclose()
    await runner.cleanup()


def step(session_id: str) -> session_pb2.CallToolRequest:
    return session_pb2.CallToolRequest(session_id=session_id, tool="step_counter")


async def test_each_call_sends_the_cookies_the_last_reply_set(flow):
    sessions, scripted = flow
    session_id, _, _ = await sessions.open(
        session_pb2.OpenSessionRequest(resources_server="s"), None
    )
    replies = [json.loads((await sessions.call_tool(step(session_id), None))[0]) for _ in range(3)]
    assert replies == [{"count": 1}, {"count": 2}, {"count": 3}]
    assert scripted.cookies == ["s=0", "s=1", "s=2"]


async def test_an_idle_session_is_closed_upstream_once_and_then_unknown(flow, monkeypatch):
    sessions, scripted = flow
    monkeypatch.setattr(session_flow, "SWEEP_EVERY", 0.02)
    request = session_pb2.OpenSessionRequest(resources_server="s", lease_seconds=0.05)
    session_id, _, _ = await sessions.open(request, None)
    for _ in range(200):
        if scripted.closed:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # a second close would have come by now
    assert [body["resources_session_id"] for body in scripted.closed] == [session_id]
    with pytest.raises(errors.ItemError) as gone:
        await sessions.call_tool(step(session_id), None)
    assert (gone.value.code, gone.value.reason) == (code_pb2.NOT_FOUND, "SESSION_NOT_FOUND")
    assert not sessions.close(session_id)


async def test_the_table_is_bounded_and_closing_makes_room(flow):
    sessions, _ = flow
    request = session_pb2.OpenSessionRequest(resources_server="s")
    first, _, _ = await sessions.open(request, None)
    await sessions.open(request, None)
    with pytest.raises(errors.ItemError) as full:
        await sessions.open(request, None)
    assert (full.value.code, full.value.reason) == (
        code_pb2.RESOURCE_EXHAUSTED,
        "TOO_MANY_SESSIONS",
    )
    assert sessions.close(first)
    await sessions.open(request, None)


async def test_opens_in_flight_count_toward_the_bound(flow):
    sessions, _ = flow
    request = session_pb2.OpenSessionRequest(resources_server="s")
    opens = [sessions.open(request, None) for _ in range(5)]  # all waiting on their seed at once
    outcomes = await asyncio.gather(*opens, return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, errors.ItemError)]
    assert len(refused) == 3 and {e.reason for e in refused} == {"TOO_MANY_SESSIONS"}
    assert len(outcomes) - len(refused) == 2


def test_cookies_merge_by_name():
    assert merged_cookies("", "a=1") == "a=1"
    assert merged_cookies("a=1; b=2", "b=3; c=4") == "a=1; b=3; c=4"
