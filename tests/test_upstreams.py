"""Head-server discovery: the double-encoded /global_config_dict_yaml reply, what an
unknown name resolves to (head server unreachable vs name absent), and how an unreachable
head server is logged."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
import requests
import yaml
from aiohttp import web
from google.rpc import code_pb2
from grpc_health.v1 import health

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.discovery import HeadServer
from nemo_gym_grpc.bridge.flows.upstreams import AGENTS, Upstreams
from nemo_gym_grpc.bridge.nemo_gym.head import (
    RESOURCES_SERVERS,
    HeadUnreadable,
    list_servers,
    load_config,
)
from nemo_gym_grpc.bridge.rpc.health import Readiness
from nemo_gym_grpc.shared import reasons
from tests.support import closed_port

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)


def test_real_head_server_reply_is_yaml_inside_a_json_string(nemo_gym):
    reply = requests.get(f"{nemo_gym.head_url}/global_config_dict_yaml", timeout=10)
    assert reply.headers["content-type"].startswith("application/json")
    assert isinstance(json.loads(reply.content), str)  # the first decode gives YAML text
    found = parse_global_config(reply.content, nemo_gym.head_url)
    assert {name: found[name] for name in nemo_gym.server_urls} == nemo_gym.server_urls


def _reply(config: dict) -> bytes:
    return json.dumps(yaml.safe_dump(config)).encode()


def parse_global_config(body: bytes, head_url: str) -> dict[str, str]:
    """{name: base URL} of the resources servers in a `/global_config_dict_yaml` body."""
    found = list_servers(load_config(body), head_url, RESOURCES_SERVERS).found
    return {name: url for name, (url, _) in found.items()}


def test_wildcard_and_localhost_hosts_are_normalised_and_types_become_aliases():
    config = {
        "math": {"resources_servers": {"math_with_judge": {"host": "0.0.0.0", "port": 1234}}},
        "local": {"resources_servers": {"mcqa": {"host": "localhost", "port": 99}}},
        "v6": {"resources_servers": {"v6type": {"host": "::1", "port": 7}}},
        "a": {"resources_servers": {"shared": {"host": "127.0.0.1", "port": 1}}},
        "b": {"resources_servers": {"shared": {"host": "127.0.0.1", "port": 2}}},
        "policy": {"responses_api_models": {"m": {"host": "127.0.0.1", "port": 5}}},
        "head_server": {"host": "127.0.0.1", "port": 11000},
    }
    found = parse_global_config(_reply(config), "http://127.0.0.2:11000")
    assert found == {
        "math": "http://127.0.0.2:1234",
        "math_with_judge": "http://127.0.0.2:1234",
        "local": "http://127.0.0.1:99",
        "mcqa": "http://127.0.0.1:99",
        "v6": "http://[::1]:7",
        "v6type": "http://[::1]:7",
        "a": "http://127.0.0.1:1",
        "b": "http://127.0.0.1:2",
    }  # "shared" is ambiguous (two servers), so it is no alias; models are no upstreams


@pytest.mark.parametrize("body", [b'{"not": "a string"}', json.dumps("- a list").encode()])
def test_malformed_replies_are_unreadable(body):
    with pytest.raises(HeadUnreadable):
        parse_global_config(body, "http://127.0.0.1:11000")


# --- resolving a name: head server unreachable vs name absent ------------------------------
# A scripted head server (an aiohttp app on loopback): the test needs one that answers, then
# fails, on demand, which a real NeMo Gym head server does not.


def _resolve_error(
    head: Callable[[], Awaitable[web.Response]] | None, name: str, *, twice: bool = False
) -> tuple[errors.ItemError, list[str]]:
    """Resolve `name` against a scripted head server whose `/global_config_dict_yaml` handler
    is `head` (None: the head server's port is closed); `twice` resolves once before (the
    minimum re-discovery interval is 0). Returns the ItemError and the discovery error seen
    after each resolve."""

    async def run() -> tuple[errors.ItemError, list[str]]:
        runner = None
        if head is None:
            head_url = f"http://127.0.0.1:{closed_port()}"
        else:
            answer = head

            async def config(_request: web.Request) -> web.Response:
                return await answer()

            app = web.Application()
            app.router.add_get("/global_config_dict_yaml", config)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            head_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        seen = []
        try:
            async with aiohttp.ClientSession() as session:
                head_server = HeadServer(head_url, session, 2.0, min_interval=0, busy_share=1)
                upstreams = Upstreams({"static": "http://127.0.0.1:1"}, head_server)
                for _ in range(2 if twice else 1):
                    try:
                        await upstreams.resolve(name)
                    except errors.ItemError as exc:
                        error = exc
                    seen.append(upstreams.discovery_error or "")
                return error, seen
        finally:
            if runner is not None:
                await runner.cleanup()

    return asyncio.run(run())


CONFIG = _reply({"mcqa": {"resources_servers": {"mcqa": {"host": "127.0.0.1", "port": 99}}}})


def test_an_unreachable_head_server_is_unavailable_not_an_unknown_name(caplog):
    with caplog.at_level("INFO", logger="nemo_gym_grpc.bridge.flows.upstreams"):
        error, _ = _resolve_error(None, "mcqa")
    assert (error.code, error.reason) == (code_pb2.UNAVAILABLE, reasons.HEAD_SERVER_UNAVAILABLE)
    assert error.metadata["discoveryError"].startswith("ClientConnectorError")
    assert error.metadata["resourcesServer"] == "mcqa"
    assert "could not be read" in error.message and "known: static" in error.message
    assert "'mcqa' is unknown: discovering from the head server" in caplog.text


async def _head_503() -> web.Response:
    return web.Response(status=503, text='{"status": "starting"}')


async def _head_ok() -> web.Response:
    return web.Response(body=CONFIG, content_type="application/json")


def test_a_head_server_that_answers_an_error_is_unavailable_too():
    error, _ = _resolve_error(_head_503, "mcqa")
    assert (error.code, error.reason) == (code_pb2.UNAVAILABLE, reasons.HEAD_SERVER_UNAVAILABLE)
    assert "503" in error.metadata["discoveryError"]


def test_a_name_the_head_server_does_not_list_is_not_found(caplog):
    with caplog.at_level("INFO", logger="nemo_gym_grpc.bridge.flows.upstreams"):
        error, seen = _resolve_error(_head_ok, "nope")
    assert (error.code, error.reason) == (code_pb2.NOT_FOUND, reasons.UNKNOWN_RESOURCES_SERVER)
    assert "discoveryError" not in error.metadata and seen == [""]
    assert error.message == "unknown resources server 'nope'; known: mcqa, static"
    assert "re-discovery found 1 resources servers" in caplog.text


def test_a_head_server_gone_since_it_last_answered_is_unavailable():
    answers = iter([_head_ok, _head_503])
    error, seen = _resolve_error(lambda: next(answers)(), "nope", twice=True)
    assert seen[0] == "" and "503" in seen[1]
    assert (error.code, error.reason) == (code_pb2.UNAVAILABLE, reasons.HEAD_SERVER_UNAVAILABLE)


def test_without_a_head_server_an_unknown_name_is_not_found():
    async def run() -> errors.ItemError:
        with pytest.raises(errors.ItemError) as caught:
            await Upstreams({"static": "http://127.0.0.1:1"}).resolve("x")
        return caught.value

    error = asyncio.run(run())
    assert (error.code, error.reason) == (code_pb2.NOT_FOUND, reasons.UNKNOWN_RESOURCES_SERVER)


async def test_an_unreachable_head_server_is_one_readable_line_not_one_per_round(caplog):
    head = f"http://127.0.0.1:{closed_port()}"
    async with aiohttp.ClientSession() as session:
        head_server = HeadServer(head, session)
        tables = Upstreams({}, head_server), Upstreams({}, head_server, kind=AGENTS)
        readiness = Readiness(
            health.aio.HealthServicer(), tables[0], session, interval=0.02, agents=tables[1]
        )
        with caplog.at_level(logging.INFO, logger="nemo_gym_grpc.bridge"):
            rounds = asyncio.create_task(readiness.run())
            await asyncio.sleep(0.4)  # about 20 rounds, each failing for both tables
            rounds.cancel()
            await asyncio.gather(rounds, return_exceptions=True)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert head in warned[0] and "Cannot connect to host" in warned[0]
    assert "ConnectionKey(" not in warned[0] and "Error(" not in warned[0]  # no raw repr
