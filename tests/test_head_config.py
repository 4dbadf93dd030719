"""The head server's config is data from outside: one that does not parse is a discovery
failure (never a crash), each server entry's host and port is checked by itself, it is parsed
off the event loop, read at a bounded rate however often callers ask, and never through a
redirect.

Scripted head servers (tests/support/canned_http.py) on loopback addresses: no real head server
serves a malformed config or a redirect on demand.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.discovery import HeadServer
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.nemo_gym import head
from nemo_gym_grpc.shared import reasons
from tests.support.canned_http import CannedServer, canned

CONFIG_PATH = "GET /global_config_dict_yaml"


def config_reply(text: str) -> bytes:
    """A head server's 200 reply whose YAML text is `text` (JSON-string encoded, as NeMo Gym)."""
    return canned(200, json.dumps(text).encode(), Content_Type="application/json")


def servers(**entries: object) -> str:
    """Global config YAML with one resources server per entry: name -> {host, port}."""
    return yaml.safe_dump({name: {"resources_servers": {name: e}} for name, e in entries.items()})


MALFORMED = {
    "broken YAML": "a: [1, 2\nb: {",
    "a python tag": "x: !!python/object/apply:os.system ['touch {marker}']\n",
    "a list": "- a\n- b\n",
    "deep nesting": "[" * 100_000,
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_config_that_does_not_parse_is_unreadable_and_runs_nothing(case, tmp_path: Path):
    marker = tmp_path / "ran"
    body = json.dumps(MALFORMED[case].replace("{marker}", str(marker))).encode()
    with pytest.raises(head.HeadUnreadable):
        head.load_config(body)
    assert not marker.exists()


BAD_ENTRIES = {
    "path_in_host": ({"host": "127.0.0.3/other/path?", "port": 9}, "not an IP address"),
    "scheme_in_host": ({"host": "file:///etc/passwd", "port": 9}, "not an IP address"),
    "port_list": ({"host": "127.0.0.1", "port": [1, 2]}, "not an integer 1-65535"),
    "port_huge": ({"host": "127.0.0.1", "port": 10_000_000_000}, "not an integer 1-65535"),
    "port_zero": ({"host": "127.0.0.1", "port": 0}, "not an integer 1-65535"),
    "host_number": ({"host": 5, "port": 9}, "not a text"),
}


def test_each_bad_entry_is_refused_by_itself_and_the_others_route():
    good = {"ok": {"host": "127.0.0.1", "port": 18001}, "named": {"host": "gym-0.svc", "port": "7"}}
    bad = {name: entry for name, (entry, _) in BAD_ENTRIES.items()}
    config = yaml.safe_load(servers(**good, **bad))
    listing = head.list_servers(config, "http://127.0.0.1:11000", head.RESOURCES_SERVERS)
    assert listing.found == {
        "ok": ("http://127.0.0.1:18001", ""),
        "named": ("http://gym-0.svc:7", ""),
    }
    assert sorted(listing.refused) == sorted(BAD_ENTRIES)
    for name, (_, why) in BAD_ENTRIES.items():
        assert why in listing.refused[name], (name, listing.refused[name])


async def resolve(head_url: str, name: str) -> errors.ItemError | list[str]:
    """What an item for `name` meets: its URLs, or its ItemError."""
    async with aiohttp.ClientSession() as session:
        table = Upstreams({}, HeadServer(head_url, session, 2.0))
        try:
            return await table.resolve(name)
        except errors.ItemError as exc:
            return exc


async def test_an_item_for_a_refused_entry_fails_with_the_reason_and_others_route(caplog):
    with CannedServer("127.0.0.4") as headsrv:
        bad = BAD_ENTRIES["path_in_host"][0]
        headsrv.answer(CONFIG_PATH, config_reply(servers(bad=bad, ok={"host": "::1", "port": 9})))
        async with aiohttp.ClientSession() as session:
            table = Upstreams({}, HeadServer(headsrv.url, session, 2.0, 0, busy_share=1))
            with caplog.at_level("WARNING", logger="nemo_gym_grpc.bridge.flows.upstreams"):
                for _ in range(3):  # three reads of the same config
                    with pytest.raises(errors.ItemError) as caught:
                        await table.resolve("bad")
            assert await table.resolve("ok") == ["http://[::1]:9"]
    error = caught.value
    assert len(caplog.records) == 1 and "'bad'" in caplog.records[0].getMessage()
    assert (error.code, error.reason) == (
        code_pb2.FAILED_PRECONDITION,
        reasons.UPSTREAM_ADDRESS_REFUSED,
    )
    assert "not an IP address" in error.metadata["why"]


async def test_an_unparsable_config_makes_unknown_names_head_server_unavailable():
    with CannedServer("127.0.0.4") as headsrv:
        headsrv.answer(CONFIG_PATH, config_reply(MALFORMED["broken YAML"]))
        error = await resolve(headsrv.url, "mcqa")
    assert isinstance(error, errors.ItemError)
    assert (error.code, error.reason) == (code_pb2.UNAVAILABLE, reasons.HEAD_SERVER_UNAVAILABLE)
    assert "does not parse" in error.metadata["discoveryError"]


async def test_a_redirecting_head_server_is_unreadable_and_its_target_never_asked():
    with CannedServer("127.0.0.2") as elsewhere, CannedServer("127.0.0.4") as headsrv:
        elsewhere.answer(CONFIG_PATH, config_reply(servers(x={"host": "127.0.0.2", "port": 9})))
        target = f"{elsewhere.url}/global_config_dict_yaml"
        headsrv.answer(CONFIG_PATH, canned(302, Location=target))
        error = await resolve(headsrv.url, "x")
    assert isinstance(error, errors.ItemError)
    assert error.reason == reasons.HEAD_SERVER_UNAVAILABLE
    assert "302" in error.message and target in error.message
    assert elsewhere.seen == []


async def test_the_config_is_parsed_off_the_event_loop(monkeypatch):
    threads = []

    def load(body):
        threads.append(threading.current_thread())
        return yaml.safe_load(json.loads(body))

    monkeypatch.setattr(head, "load_config", load)
    with CannedServer("127.0.0.4") as headsrv:
        headsrv.answer(CONFIG_PATH, config_reply(servers(ok={"host": "127.0.0.1", "port": 9})))
        assert await resolve(headsrv.url, "ok") == ["http://127.0.0.1:9"]
    assert threads and threading.main_thread() not in threads


async def test_callers_naming_unknown_servers_do_not_make_it_read_more_than_once_a_second():
    with CannedServer("127.0.0.4") as headsrv:
        headsrv.answer(CONFIG_PATH, config_reply(servers(ok={"host": "127.0.0.1", "port": 9})))
        async with aiohttp.ClientSession() as session:
            head_server = HeadServer(headsrv.url, session, 2.0)
            tables = [Upstreams({}, head_server) for _ in range(2)]
            for round_ in range(12):  # 1.2 s of unknown names, from two tables
                calls = (t.resolve(f"nope-{round_}-{i}") for i in range(20) for t in tables)
                await asyncio.gather(*calls, return_exceptions=True)
                await asyncio.sleep(0.1)
    assert 1 <= headsrv.seen.count(CONFIG_PATH) <= 2, headsrv.seen
    assert head_server.reads == headsrv.seen.count(CONFIG_PATH)


def test_a_bridge_starts_before_a_sane_head_server_and_routes_once_there_is_one(start_bridge):
    from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

    with CannedServer("127.0.0.4") as headsrv:
        headsrv.answer(CONFIG_PATH, config_reply("x: !!python/object/apply:os.getpid []\n"))
        bridge = start_bridge("--head-url", headsrv.url)
        with grpc.insecure_channel(bridge.target) as channel:
            stub = verify_pb2_grpc.VerifyServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.ListResourcesServers(verify_pb2.ListResourcesServersRequest(refresh=True))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "does not parse" in caught.value.details()
            headsrv.answer(CONFIG_PATH, config_reply(servers(ok={"host": "127.0.0.1", "port": 9})))
            listed = _listed_after_refresh(stub, verify_pb2)
    assert "ok" in listed
    assert "Traceback" not in bridge.stderr_tail(200)


def _listed_after_refresh(stub, verify_pb2) -> list[str]:
    """The resources servers a refreshing List shows, once the bridge's next read is due."""
    from tests.support.waiting import wait_until

    names: list[str] = []

    def listed() -> bool:
        try:
            reply = stub.ListResourcesServers(verify_pb2.ListResourcesServersRequest(refresh=True))
        except grpc.RpcError:
            return False
        names[:] = [server.name for server in reply.resources_servers]
        return bool(names)

    wait_until(listed, 10, "the fixed config listed")
    return names


async def test_a_server_that_moved_takes_items_again_once_the_head_server_lists_it_there():
    from nemo_gym_grpc.v1 import verify_pb2
    from tests.support import closed_port
    from tests.support.verifiers import verifier_for

    def item(request_id: str) -> verify_pb2.VerifyRequest:
        return verify_pb2.VerifyRequest(request_id=request_id, resources_server="h", completion="B")

    gone = {"host": "127.0.0.2", "port": closed_port()}
    with CannedServer("127.0.0.4") as headsrv, CannedServer("127.0.0.3") as moved:
        moved.answer("POST /verify", canned(200, b'{"reward": 1.0}'))
        headsrv.answer(CONFIG_PATH, config_reply(servers(h=gone)))
        async with aiohttp.ClientSession() as session:
            head_server = HeadServer(headsrv.url, session, 2.0, min_interval=0.2, busy_share=1)
            verifier = verifier_for(Upstreams({}, head_server), session)
            before = await verifier.verify(item("before"), None)
            port = int(moved.url.rsplit(":", 1)[1])
            headsrv.answer(
                CONFIG_PATH, config_reply(servers(h={"host": "127.0.0.3", "port": port}))
            )
            await asyncio.sleep(0.3)  # the next read is due
            first = await verifier.verify(item("first"), None)
            after = await verifier.verify(item("after"), None)
    assert before.error.code == code_pb2.UNAVAILABLE  # refused, nowhere else to go yet
    assert first.reward == 1.0 and after.reward == 1.0, (first, after)
    assert moved.seen.count("POST /verify") == 2, moved.seen
    # read at the first item and again once refused (the first item's own retries, their
    # backoff random, may come after the 0.2 s interval and read once more: the rate is
    # test_callers_naming_unknown_servers_do_not_make_it_read_more_than_once_a_second's)
    assert headsrv.seen.count(CONFIG_PATH) in (2, 3), headsrv.seen
