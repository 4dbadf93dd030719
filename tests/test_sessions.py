"""NeMo Gym sessions through the bridge, against NeMo Gym's real example_session_state_mgmt.

That server keeps a counter per session: `/seed_session` with `initial_count` sets it, and
`/verify` rewards 1.0 when the row's `expected_count` equals the counter of the session its
cookie names (a request without the cookie gets a new, empty session: 0.0).
"""

from __future__ import annotations

import json

import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.v1 import verify_pb2
from tests.support import closed_port, example_rows, start_bridge
from tests.support.items import error_info
from tests.support.items import scored as stream

SERVER = "example_session_state_mgmt"


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
