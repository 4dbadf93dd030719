"""What the bridge learns of each replica (NeMo Gym 0.7's routes or 0.4's), and what it then
sends: typed or legacy seeds, `/close_session`, the `/ng-rollout/<id>` prefix, and no
`/verify` retry where `/reverify_mode` is "unsupported".

The upstream is a loopback stand-in (`Stand7`), because these tests need route shapes and
faults on demand that no runnable server has: a typed-only `/seed_session` (0.7's
nemo_user_sim, which needs the `usersim` package: it does not run offline), a `/verify` that
answers 503 on a server whose reverify mode is "unsupported" or "unknown", a close that fails
or hangs, an `/openapi.json` that never answers. The real 0.7 and 0.4 servers are in
test_sessions.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import aiohttp
import pytest
from aiohttp import web
from google.rpc import error_details_pb2

from nemo_gym_grpc.bridge.flows.attempts import RetryPolicy
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.flows.verify import Verifier
from nemo_gym_grpc.bridge.nemo_gym import capabilities, correlation, http
from nemo_gym_grpc.bridge.process.metrics import Metrics
from nemo_gym_grpc.v1 import verify_pb2
from tests.support.waiting import until

PREFIX = re.compile(r"^/ng-rollout/([A-Za-z0-9][A-Za-z0-9._-]*)(/.*)$")
TYPED = {"$ref": "#/components/schemas/ResourcesSeedSessionRequest"}
LEGACY = {"$ref": "#/components/schemas/BaseSeedSessionRequest"}
CUSTOM = {"$ref": "#/components/schemas/StatefulCounterSeedSessionRequest"}


def openapi(seed: dict, *routes: str) -> dict:
    """An OpenAPI document with `/seed_session` taking `seed` and `routes` besides."""
    body = {"requestBody": {"content": {"application/json": {"schema": seed}}}}
    paths = {"/seed_session": {"post": body}, "/verify": {"post": {}}}
    return {"openapi": "3.1.0", "paths": paths | {route: {} for route in routes}}


class Stand7:
    """A resources server stand-in: serves `doc` at /openapi.json, `mode` at
    /reverify_mode (when `doc` lists it), strips the rollout prefix when `prefix`, and records
    every POST as (rollout id or None, route, JSON body, Cookie header) in `seen`.
    `verify_status` / `close_status` are their HTTP status; `close_hang` never answers."""

    def __init__(self, doc: dict, mode: str = "unknown", prefix: bool = True) -> None:
        self.doc, self.mode, self.prefix = doc, mode, prefix
        self.verify_status, self.close_status, self.close_hang = 200, 200, False
        self.openapi_hang = False
        self.seen: list[tuple[str | None, str, dict, str]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path, rollout = request.path, None
        match = PREFIX.match(path)
        if match and self.prefix:
            rollout, path = match.groups()
        if request.method == "GET":
            if path == "/openapi.json":
                if self.openapi_hang:
                    await asyncio.Event().wait()
                return web.json_response(self.doc)
            if path == "/reverify_mode" and path in self.doc["paths"]:
                return web.json_response(self.mode)
            return web.json_response({"detail": "Not Found"}, status=404)
        body = json.loads(await request.read() or b"{}")
        self.seen.append((rollout, path, body, request.headers.get("Cookie", "")))
        if path == "/seed_session":
            reply = web.json_response({})
            reply.set_cookie("session", f"c{len(self.seen)}")
            return reply
        if path == "/close_session":
            if self.close_hang:
                await asyncio.Event().wait()
            return web.json_response({}, status=self.close_status)
        if path == "/verify":
            return web.json_response({"reward": 1.0}, status=self.verify_status)
        return web.json_response({"detail": "Not Found"}, status=404)

    async def __aenter__(self) -> Stand7:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.01)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def routes(self) -> list[tuple[str | None, str]]:
        return [(rollout, route) for rollout, route, _, _ in self.seen]


def verifier(session: aiohttp.ClientSession, url: str, **settings) -> Verifier:
    defaults = dict(
        default_timeout=5.0,
        max_in_flight=4,
        retry=RetryPolicy(attempts=3, budget=10.0, initial_backoff=0.01, max_backoff=0.02),
        max_item_bytes=1 << 20,
        session_servers=(),
        metrics=Metrics(),
    )
    upstreams = Upstreams({"s": url})
    return Verifier(upstreams, http.Client(session), **(defaults | settings))


def item(request_id: str, seed: bool = True) -> verify_pb2.VerifyRequest:
    return verify_pb2.VerifyRequest(
        request_id=request_id,
        resources_server="s",
        row_json='{"question": "q", "initial_count": 3}',
        completion="a",
        seed_session=seed,
    )


def test_what_an_openapi_document_shows():
    assert capabilities.read_openapi(openapi(TYPED, "/close_session")) == capabilities.Capabilities(
        typed_seed_only=True, close_session=True, learned=True, typed_seed=True
    )
    both = capabilities.read_openapi(openapi({"anyOf": [TYPED, LEGACY]}, "/close_session"))
    assert not both.typed_seed_only and not both.custom_seed and both.close_session
    custom = capabilities.read_openapi(openapi(CUSTOM))
    assert custom.custom_seed and not custom.typed_seed_only and not custom.close_session
    assert capabilities.read_openapi({"paths": 7}) == capabilities.Capabilities(learned=True)
    doc = openapi(LEGACY)
    doc["paths"] |= {
        "/get_weather": {"post": {}},
        "/aggregate_metrics": {"post": {}},
        "/status": {"get": {}},
        "/ng-rollout/{rollout_id}/get_weather": {"post": {}},
    }
    tools = capabilities.read_openapi(doc)
    assert tools.tools == ("get_weather",) and not tools.typed_seed and not tools.step_wise
    # a gymnasium-style server (0.7's GymnasiumServer: blackjack, wordle, ...)
    gym = {"paths": {p: {"post": {}} for p in ("/reset", "/step", "/aggregate_metrics")}}
    step_wise = capabilities.read_openapi(gym)
    assert step_wise.step_wise and step_wise.tools == () and not step_wise.close_session
    gym["paths"]["/verify"] = {"post": {}}
    assert not capabilities.read_openapi(gym).step_wise


def test_the_rollout_prefix_is_the_episode_capture_key_and_only_for_valid_ids():
    assert correlation.rollout_prefix("batch-3.7_x", 1) == "/ng-rollout/batch-3.7_x"
    assert correlation.rollout_prefix("batch-3", 2) == "/ng-rollout/batch-3-a1"
    assert correlation.rollout_prefix("batch-3", 4) == "/ng-rollout/batch-3-a3"
    for bad in ("", ".x", "-x", "a/b", "a b", "é", "x-a1", "x-a12"):
        assert correlation.rollout_prefix(bad, 1) == ""
    assert correlation.rollout_prefix("x-a0", 1) == "/ng-rollout/x-a0"  # not the reserved form
    longest = "x" * correlation.MAX_ROUTED_ID  # longer ids stay out of URLs (and their cache)
    assert correlation.rollout_prefix(longest, 1) == f"/ng-rollout/{longest}"
    assert correlation.rollout_prefix(longest + "x", 1) == ""


async def test_a_typed_only_server_gets_typed_seed_and_close_under_the_rollout_prefix():
    async with Stand7(openapi(TYPED, "/close_session", "/reverify_mode")) as server:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            bridge = verifier(session, server.url)
            result = await bridge.verify(item("r-7"), None)
            assert result.WhichOneof("outcome") == "reward", result.error.message
            await until(lambda: len(server.seen) == 3, 5, "3 POSTs")
            await bridge.aclose()
    assert server.routes() == [
        ("r-7", "/seed_session"),
        ("r-7", "/verify"),
        ("r-7", "/close_session"),
    ]
    (_, _, seed, _), (_, _, _, cookie), (_, _, close, close_cookie) = server.seen
    session_id = seed["resources_session_id"]
    assert seed == {
        "resources_session_id": session_id,
        "episode_id": {"rollout_id": "r-7", "attempt": 0},
        "task_id": {"taskset": "s", "task_id": "r-7"},
        "task_data": {
            "question": "q",
            "initial_count": 3,
            "responses_create_params": seed["task_data"]["responses_create_params"],
        },
    }
    assert close == {"resources_session_id": session_id, "episode_id": seed["episode_id"]}
    assert cookie == close_cookie == "session=c1"


async def test_a_server_that_takes_both_gets_the_legacy_seed_and_a_close():
    async with Stand7(
        openapi({"anyOf": [TYPED, LEGACY]}, "/close_session", "/reverify_mode")
    ) as server:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            bridge = verifier(session, server.url)
            await bridge.verify(item("id é"), None)  # no valid rollout id: plain routes
            await until(lambda: len(server.seen) == 3, 5, "3 POSTs")
    assert server.routes() == [(None, "/seed_session"), (None, "/verify"), (None, "/close_session")]
    seed, close = server.seen[0][2], server.seen[2][2]
    assert "resources_session_id" not in seed and seed["question"] == "q"
    rollout = close["episode_id"]["rollout_id"]
    assert rollout == close["resources_session_id"] and correlation.rollout_prefix(rollout, 1)


async def test_a_04_server_gets_plain_routes_and_no_close():
    async with Stand7(openapi(LEGACY), prefix=False) as server:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            bridge = verifier(session, server.url)
            result = await bridge.verify(item("r-1"), None)
            await asyncio.sleep(0.1)
    assert result.reward == 1.0
    assert server.routes() == [(None, "/seed_session"), (None, "/verify")]


async def test_correlation_off_sends_plain_routes_and_retries_carry_the_attempt_suffix():
    doc = openapi(LEGACY, "/reverify_mode")
    async with Stand7(doc, mode="stateless") as server:
        server.verify_status = 503
        async with aiohttp.ClientSession() as session:
            result = await verifier(session, server.url).verify(item("r", seed=False), None)
            assert result.error.code and len(server.seen) == 3
            assert server.routes() == [("r", "/verify"), ("r-a1", "/verify"), ("r-a2", "/verify")]
            server.seen.clear()
            off = verifier(session, server.url, rollout_correlation=False)
            await off.verify(item("r", seed=False), None)
            assert server.routes() == [(None, "/verify")] * 3


@pytest.mark.parametrize(
    ("mode", "attempts"), [("unsupported", 1), ("unknown", 3), ("stateless", 3)]
)
async def test_a_verify_that_may_have_run_is_retried_only_where_reverify_is_safe(mode, attempts):
    async with Stand7(openapi(LEGACY, "/reverify_mode"), mode=mode) as server:
        server.verify_status = 503
        async with aiohttp.ClientSession() as session:
            result = await verifier(session, server.url).verify(item("r", seed=False), None)
    assert len(server.seen) == attempts
    metadata = {key: value for detail in result.error.details for key, value in _info(detail)}
    assert metadata["attempts"] == str(attempts)
    assert metadata.get("reverifyMode") == ("unsupported" if mode == "unsupported" else None)


def _info(detail) -> list[tuple[str, str]]:
    info = error_details_pb2.ErrorInfo()
    detail.Unpack(info)
    return list(info.metadata.items())


async def test_a_refused_connection_is_retried_even_where_reverify_is_unsupported():
    server = Stand7(openapi(LEGACY, "/reverify_mode"), mode="unsupported")
    async with server:
        # No keep-alive: a call on a connection the server closed may have reached it.
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True)
        ) as session:
            bridge = verifier(session, server.url)
            assert (await bridge.verify(item("first", seed=False), None)).reward == 1.0
            await server.runner.cleanup()  # learned "unsupported"; now it refuses connections
            # The kept-alive connection the server just closed is dropped from the pool once
            # the close is read; a POST on it before that may have reached the server.
            await asyncio.sleep(0.1)
            result = await bridge.verify(item("second", seed=False), None)
            server.runner = web.AppRunner(web.Application())
            await server.runner.setup()
    metadata = dict(kv for detail in result.error.details for kv in _info(detail))
    assert metadata["attempts"] == "3" and "reverifyMode" not in metadata


async def test_a_failed_close_is_counted_and_logged_never_the_items_result(caplog):
    async with Stand7(openapi(TYPED, "/close_session")) as server:
        server.close_status = 500
        async with aiohttp.ClientSession() as session:
            bridge = verifier(session, server.url)
            with caplog.at_level(logging.WARNING):
                result = await bridge.verify(item("r"), None)
                await until(
                    lambda: (
                        bridge.metrics.closes.labels("s", "UPSTREAM_HTTP_ERROR")._value.get() == 1
                    ),
                    5,
                    "the failed close counted",
                )
    assert result.reward == 1.0
    assert "not closed" in caplog.text


async def test_a_hanging_close_is_cancelled_on_drain():
    async with Stand7(openapi(TYPED, "/close_session")) as server:
        server.close_hang = True
        async with aiohttp.ClientSession() as session:
            bridge = verifier(session, server.url)
            assert (await bridge.verify(item("r"), None)).reward == 1.0
            await until(lambda: server.routes()[-1:] == [(None, "/close_session")], 5, "a close")
            async with asyncio.timeout(1.0):
                await bridge.aclose()


async def test_an_openapi_that_never_answers_costs_one_bounded_wait_then_legacy(monkeypatch):
    monkeypatch.setattr(capabilities, "LEARN_TIMEOUT", 0.3)
    async with Stand7(openapi(TYPED, "/close_session", "/reverify_mode")) as server:
        server.openapi_hang = True
        async with aiohttp.ClientSession() as session:
            bridge = verifier(session, server.url)
            bridge.capabilities = capabilities.Catalog(session, timeout=0.3)
            loop = asyncio.get_running_loop()
            started = loop.time()
            result = await bridge.verify(item("r"), None)
            took = loop.time() - started
            await bridge.aclose()
    assert result.reward == 1.0 and took < 2.0
    assert server.routes() == [(None, "/seed_session"), (None, "/verify")]  # legacy, no close


async def test_a_deadline_spent_learning_the_replica_says_so_not_a_slot_wait(monkeypatch):
    # was: "the RPC deadline passed while waiting 0.000 s for a free slot" (no slot was awaited)
    async with Stand7(openapi(TYPED, "/close_session")) as server:
        server.openapi_hang = True
        async with aiohttp.ClientSession() as session:
            bridge = verifier(session, server.url)
            bridge.capabilities = capabilities.Catalog(session, timeout=5.0)
            deadline = time.monotonic() + 0.3
            result = await bridge.verify(item("r", seed=False), deadline)
            await bridge.aclose()
    assert result.WhichOneof("outcome") == "error", result
    assert result.error.code == 4  # DEADLINE_EXCEEDED
    assert f"while learning what {server.url} supports (GET /openapi.json" in result.error.message
    assert "slot" not in result.error.message and server.seen == []


async def test_an_item_without_a_session_on_a_stateful_server_is_counted_and_warned(caplog):
    async with Stand7(openapi(CUSTOM, "/close_session")) as server:
        async with aiohttp.ClientSession() as session:
            bridge = verifier(session, server.url)
            with caplog.at_level(logging.WARNING):
                for i in range(3):
                    await bridge.verify(item(f"r{i}", seed=False), None)
    assert bridge.metrics.unseeded.labels("s")._value.get() == 3
    assert caplog.text.count("--session-server s") == 1
