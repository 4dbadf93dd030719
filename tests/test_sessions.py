"""NeMo Gym sessions through the bridge, against NeMo Gym's real example_session_state_mgmt.

That server keeps a counter per session: `/seed_session` with `initial_count` sets it, and
`/verify` rewards 1.0 when the row's `expected_count` equals the counter of the session its
cookie names (a request without the cookie gets a new, empty session: 0.0). It takes only the
legacy seed body (the row) on both 0.4 and 0.7; on 0.7 the bridge also closes each session
(`/close_session`) and sends its calls under `/ng-rollout/<request_id>`. Typed seeds and
`/reverify_mode` are also checked on the real 0.7 mcqa, which takes both seed forms.
"""

from __future__ import annotations

import itertools
import json
import time

import aiohttp
import grpc
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.bridge.nemo_gym import capabilities, http, sessions
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port, example_rows, start_bridge
from tests.support.fault_proxy import FaultProxy
from tests.support.items import error_info
from tests.support.items import scored as stream

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)

SERVER = "example_session_state_mgmt"


def is_07(version: str) -> bool:
    """Whether NeMo Gym `version` has 0.7's session, correlation and reverify routes."""
    return tuple(int(part) for part in version.split(".")[:2]) >= (0, 7)


@pytest.fixture(scope="module")
def bridge(nemo_gym):
    """Routes: the real server by its discovered name; "counter_localhost" (the same server
    by host name, so a cookie jar would keep its cookies: aiohttp's default jar ignores
    cookies of IP addresses); "counter_always" (the same, listed with --session-server);
    "down" (a closed port, also a session server)."""
    url = nemo_gym.server_urls[SERVER]
    with start_bridge(
        "--head-url",
        nemo_gym.head_url,
        "--server",
        f"counter_localhost={url.replace('127.0.0.1', 'localhost')}",
        "--server",
        f"counter_always={url}",
        "--session-server",
        "counter_always",
        "--server",
        f"down=http://127.0.0.1:{closed_port()}",
        "--session-server",
        "down",
        "--health-interval",
        "600",
    ) as running:
        yield running


def counter_item(
    request_id: str, initial: int, expected: int, seed: bool, server: str = SERVER
) -> verify_pb2.VerifyRequest:
    """The server's first example row with these counts."""
    row = dict(example_rows(SERVER)[0], initial_count=initial, expected_count=expected)
    return verify_pb2.VerifyRequest(
        request_id=request_id,
        resources_server=server,
        row_json=json.dumps(row),
        completion="The count is what you asked for.",
        seed_session=seed,
    )


def reward(result: verify_pb2.VerifyResponse) -> float:
    assert not result.HasField("error"), result.error.message
    return result.reward


def test_the_example_row_scores_one_with_a_session_and_zero_without(stub):
    row = example_rows(SERVER)[0]
    assert row["initial_count"] != row["expected_count"]  # the shipped row needs tool calls
    count = row["initial_count"]
    with_session = stub.Verify(counter_item("s", count, count, seed=True), timeout=30)
    without = stub.Verify(counter_item("n", count, count, seed=False), timeout=30)
    assert reward(with_session) == 1.0
    assert reward(without) == 0.0


@pytest.mark.parametrize("server", [SERVER, "counter_localhost"])
def test_every_item_of_a_batch_has_its_own_session_and_no_cookie_leaks(stub, server):
    """48 items in one message, all in flight together: 16 sessions whose counts match, 16
    whose expected count is the next item's initial count (1.0 only if a cookie of another
    item reached its /verify), 16 without a session expecting a count some session holds."""
    items = []
    for i in range(16):
        items.append(counter_item(f"own-{i}", 100 + i, 100 + i, seed=True, server=server))
        items.append(counter_item(f"other-{i}", 100 + i, 101 + i, seed=True, server=server))
        items.append(counter_item(f"none-{i}", 100 + i, 100 + i, seed=False, server=server))
    results = stream(stub, items)
    for i in range(16):
        assert reward(results[f"own-{i}"]) == 1.0
        assert reward(results[f"other-{i}"]) == 0.0
        assert reward(results[f"none-{i}"]) == 0.0


def test_a_session_server_flag_seeds_every_item_of_that_server(stub):
    results = stream(
        stub, [counter_item(f"a{i}", i, i, seed=False, server="counter_always") for i in range(4)]
    )
    assert [reward(results[f"a{i}"]) for i in range(4)] == [1.0] * 4


def test_a_stateless_server_scores_the_same_with_a_session(stub):
    row = example_rows("mcqa")[0]
    items = [
        verify_pb2.VerifyRequest(
            request_id=f"m{seed}",
            resources_server="mcqa",
            row_json=json.dumps(row),
            completion=f"\\boxed{{{row['expected_answer']}}}",
            seed_session=seed,
        )
        for seed in (True, False)
    ]
    results = stream(stub, items)
    assert reward(results["mTrue"]) == reward(results["mFalse"]) == 1.0


def test_seed_session_failures_are_item_errors_with_their_own_reason(stub):
    """A row the real server's /seed_session rejects (no `initial_count`: HTTP 422) and an
    upstream that refuses connections; neither is a reward, the rest of the batch is scored."""
    row = dict(example_rows(SERVER)[0], expected_count=0)
    del row["initial_count"]
    rejected = verify_pb2.VerifyRequest(
        request_id="rejected", resources_server=SERVER, row_json=json.dumps(row), seed_session=True
    )
    down = counter_item("down", 1, 1, seed=False, server="down")
    results = stream(stub, [rejected, down, counter_item("fine", 5, 5, seed=True)])
    assert reward(results["fine"]) == 1.0

    failed = results["rejected"]
    info = error_info(failed)
    assert (failed.error.code, info.reason) == (
        code_pb2.INVALID_ARGUMENT,
        "UPSTREAM_SESSION_FAILED",
    )
    assert info.metadata["httpStatus"] == "422" and info.metadata["attempts"] == "1"
    assert info.metadata["upstreamUrl"].endswith("/seed_session")
    assert "initial_count" in failed.error.message and failed.reward == 0.0

    failed = results["down"]
    info = error_info(failed)
    assert (failed.error.code, info.reason) == (code_pb2.UNAVAILABLE, "UPSTREAM_SESSION_FAILED")
    assert info.metadata["attempts"] == "3"  # transient: retried like /verify
    assert info.metadata["upstreamUrl"].endswith("/seed_session")


def test_an_item_without_a_session_on_this_server_is_named_in_the_log(stub, bridge):
    """What's wrong without --session-server: the server scores 0.0; the bridge says why."""
    count = example_rows(SERVER)[0]["initial_count"]
    # The bridge knows the server keeps state once it has read the server's routes (learned
    # on first use, in the background past 2 s): items sent before that are not counted.
    deadline = time.monotonic() + 60
    for attempt in itertools.count():
        item = counter_item(f"unseeded-{attempt}", count, count, seed=False)
        assert reward(stub.Verify(item, timeout=30)) == 0.0
        if f"--session-server {SERVER}" in bridge.stderr_tail(100_000):
            break
        assert time.monotonic() < deadline, bridge.stderr_tail()
        time.sleep(0.2)


def test_each_session_is_closed_once_and_calls_carry_the_rollout_id_on_07_only(nemo_gym):
    """Through the fault proxy (which sees every POST by path and X-Request-Id): 8 items of a
    --session-server, each 1.0; on 0.7 each item's seed, verify and close go under
    /ng-rollout/<request_id>, and its session is closed exactly once; on 0.4 (no such routes)
    plain /seed_session and /verify, nothing else."""
    ids = [f"close-{i}" for i in range(8)]
    with FaultProxy(nemo_gym.server_urls[SERVER]) as proxy:
        args = ("--server", f"proxied={proxy.url}", "--session-server", "proxied")
        with start_bridge(*args, "--health-interval", "600") as running:
            with grpc.insecure_channel(running.target) as channel:
                stub_ = verify_pb2_grpc.VerifyServiceStub(channel)
                items = [counter_item(i, 7, 7, seed=False, server="proxied") for i in ids]
                results = stream(stub_, items)
            assert [reward(results[i]) for i in ids] == [1.0] * 8
            routes = ("seed_session", "verify", "close_session")
            if is_07(nemo_gym.version):
                expected = {(f"/ng-rollout/{i}/{route}", i): 1 for i in ids for route in routes}
            else:
                expected = {(f"/{route}", i): 1 for i in ids for route in routes[:2]}
            deadline = time.monotonic() + 10  # the closes run in the background
            while dict(proxy.posts) != expected and time.monotonic() < deadline:
                time.sleep(0.05)
            assert dict(proxy.posts) == expected
            assert dict(proxy.attempts) == dict.fromkeys(ids, 1)


async def test_what_the_bridge_learns_of_the_real_servers(nemo_gym):
    async with aiohttp.ClientSession() as session:
        catalog = capabilities.Catalog(session)
        counter = await catalog.of(nemo_gym.server_urls[SERVER], 10)
        mcqa = await catalog.of(nemo_gym.server_urls["mcqa"], 10)
    assert counter.learned and counter.custom_seed and not counter.typed_seed_only
    assert mcqa.learned and not mcqa.custom_seed and not mcqa.typed_seed_only
    if is_07(nemo_gym.version):
        assert (mcqa.close_session, mcqa.correlation, mcqa.reverify_mode) == (
            True,
            True,
            "stateless",
        )
        assert (counter.close_session, counter.correlation, counter.reverify_mode) == (
            True,
            True,
            "unknown",
        )
    else:
        for caps in (counter, mcqa):
            assert (caps.close_session, caps.correlation, caps.reverify_mode) == (False, False, "")


@pytest.mark.nemo_gym_07
async def test_the_typed_seed_and_close_the_bridge_builds_are_accepted_by_the_real_mcqa(
    nemo_gym,
):
    """mcqa takes both seed forms (the bridge sends it the legacy one); the typed body the
    bridge sends a typed-only server is checked here against the real schema (extra=forbid)."""
    url = nemo_gym.server_urls["mcqa"]
    row = example_rows("mcqa")[0]
    opened = sessions.open_session("typed-1", 1)
    legacy = sessions.seed_body(dict(row, response={}))
    typed = sessions.typed_seed_body(opened, "mcqa", "typed-1", legacy)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        client = http.Client(session)
        seeded = await http.post(client, url + "/seed_session", typed, timeout=10, request_id="t")
        assert seeded.status == 200, seeded.body
        assert json.loads(seeded.body)["resources_session_id"] == opened.session_id
        cookie = sessions.cookie_header(seeded.set_cookies, url)
        assert cookie
        body = sessions.close_body(opened.session_id, opened.episode)
        closed = await http.post(
            client, url + "/close_session", body, timeout=10, request_id="t", cookie=cookie
        )
        await client.aclose()
    assert closed.status == 200, closed.body
    assert json.loads(closed.body) == {"resources_session_id": opened.session_id}
