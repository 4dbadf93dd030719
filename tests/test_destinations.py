"""The address policy (`--deny-upstream`, `--allow-upstream`, link-local denied by default):
a refused upstream is never connected to, written as an address or reached through a name,
over both HTTP clients, and its items fail FAILED_PRECONDITION / UPSTREAM_ADDRESS_REFUSED.

Refusal before connecting is shown with loopback addresses on the deny list and scripted
servers there (tests/support/canned_http.py) that count what reaches them: no test dials an
address outside loopback, not even one that should be refused.
"""

from __future__ import annotations

import ipaddress

import grpc
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym import destinations, http
from nemo_gym_grpc.bridge.rpc.server import _session
from nemo_gym_grpc.shared import reasons
from tests.support.canned_http import CannedServer, canned

CLIENTS = {"plain_http": True, "aiohttp": False}
OK = canned(200, b'{"reward": 1.0}')


def policy(deny: tuple[str, ...] = (), allow: tuple[str, ...] = ()) -> destinations.Policy:
    nets = tuple(ipaddress.ip_network(n) for n in deny)
    return destinations.Policy(
        destinations.DEFAULT_DENY + nets, tuple(ipaddress.ip_network(n) for n in allow)
    )


def test_the_rule_link_local_by_default_mapped_addresses_and_the_allow_list():
    # the default deny list is the link-local ranges of both families (no such address named)
    default = destinations.Policy()
    assert {n.version for n in default.deny} == {4, 6}
    assert all(n.is_link_local for n in default.deny)
    assert default.refuses("127.0.0.1") == "" and default.refuses("10.1.2.3") == ""
    # how a range is matched, on loopback ranges: a scope id, an IPv4-mapped address
    rule = policy(deny=("127.0.0.6/32", "::1/128"))
    assert "::1/128" in rule.refuses("::1%lo")
    assert "127.0.0.6/32" in rule.refuses("::ffff:127.0.0.6")  # IPv4-mapped
    only = policy(allow=("127.0.0.5/32",))
    assert only.refuses("127.0.0.5") == ""
    assert "none of the allowed ranges (127.0.0.5/32)" in only.refuses("127.0.0.7")
    assert only.literal_refused("gym.svc") == ""  # names are judged as they resolve


async def post(client_kind: str, rule: destinations.Policy, url: str) -> object:
    """POST `url` over one client under `rule`: the Reply or the ItemError."""
    async with _session(rule) as session:
        client = http.Client(session, builtin=CLIENTS[client_kind], policy=rule)
        try:
            return await http.post(client, url, b"{}", timeout=10, request_id="r")
        except errors.ItemError as exc:
            return exc
        finally:
            await client.aclose()


def assert_refused(got: object, needle: str) -> None:
    assert isinstance(got, errors.ItemError), got
    assert (got.code, got.reason) == (
        code_pb2.FAILED_PRECONDITION,
        reasons.UPSTREAM_ADDRESS_REFUSED,
    )
    assert not got.retryable and needle in got.metadata["why"], got.metadata


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_a_denied_address_is_never_connected_to(client):
    with CannedServer("127.0.0.6") as denied, CannedServer("127.0.0.5") as allowed:
        denied.answer("POST /verify", OK)
        allowed.answer("POST /verify", OK)
        rule = policy(deny=("127.0.0.6/32",))
        assert_refused(await post(client, rule, f"{denied.url}/verify"), "127.0.0.6/32")
        assert isinstance(await post(client, rule, f"{allowed.url}/verify"), http.Reply)
        outside = policy(allow=("127.0.0.6/32",))
        assert_refused(await post(client, outside, f"{allowed.url}/verify"), "none of")
    assert denied.seen == [] and allowed.seen == ["POST /verify"]


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_a_name_that_resolves_into_a_denied_range_is_never_connected_to(client):
    with CannedServer("127.0.0.1") as server:
        server.answer("POST /verify", OK)
        port = server.url.rsplit(":", 1)[1]
        rule = policy(deny=("127.0.0.0/8", "::1/128"))
        got = await post(client, rule, f"http://localhost:{port}/verify")
        assert_refused(got, "denied range")
        assert isinstance(
            await post(client, policy(), f"http://localhost:{port}/verify"), http.Reply
        )
    assert server.seen == ["POST /verify"]  # only the call the default policy let through


async def test_a_denied_server_is_not_serving_and_its_probe_never_sent():
    with CannedServer("127.0.0.6") as denied:
        denied.answer("GET /", canned(200, b"{}"))
        async with _session(policy(deny=("127.0.0.6/32",))) as session:
            assert not await http.answers(session, denied.url, 5.0)
    assert denied.seen == []


def test_a_bridge_refuses_what_its_flags_deny(start_bridge):
    from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

    with CannedServer("127.0.0.6") as denied:
        denied.answer("POST /verify", OK)
        bridge = start_bridge(
            "--server", f"s={denied.url}", "--deny-upstream", "127.0.0.6/32"
        )  # fmt: skip
        with grpc.insecure_channel(bridge.target) as channel:
            stub = verify_pb2_grpc.VerifyServiceStub(channel)
            reply = stub.Verify(
                verify_pb2.VerifyRequest(request_id="a", resources_server="s", completion="B"),
                timeout=30,
            )
    assert reply.error.code == code_pb2.FAILED_PRECONDITION
    assert "127.0.0.6/32" in reply.error.message
    assert denied.seen == []


def test_score_takes_a_refused_address_for_no_verdict_on_the_row():
    from nemo_gym_grpc.rewards.client.outcomes import Failure
    from nemo_gym_grpc.rewards.tools.scorefile import is_verdict

    refused = Failure("FAILED_PRECONDITION", reasons.UPSTREAM_ADDRESS_REFUSED, "not dialed")
    too_large = Failure("FAILED_PRECONDITION", reasons.UPSTREAM_REPLY_TOO_LARGE, "64 MiB")
    assert not is_verdict(refused) and is_verdict(too_large)
