"""NeMo Gym 0.7's reply vocabulary and the contract fixes, through a real bridge process and
real gRPC over loopback.

The upstream is scripted (tests/support/fault_proxy.py with no upstream: it answers each item
with the reply its body matches): NeMo Gym 0.4.0 has no `mask_sample` / `failure_kind`, and
no 0.7.0 server that runs offline here produces a degraded-but-valid reply on demand
(nemo_user_sim needs the `usersim` package and a user model; the sandbox tools need a
sandbox). The replies are the notes' Step 4 table, cases A-I (what real 0.7.0 servers send,
`judge_failsafe`'s row captured from one). The last test runs real 0.7.0 mcqa, whose success
replies carry the new keys unset.
"""

from __future__ import annotations

import json

import grpc
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.rewards import create_nemo_gym_reward_fn
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port, example_rows
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.items import error_info, mcqa_item, scored, wrong_letter
from tests.test_nemo_gym_adapter import MASKED_07, SCORED_07

ROW = {"question": "2+2?", "expected_answer": "A"}


def item(request_id: str, completion: str, server: str = "scripted", **fields):
    return verify_pb2.VerifyRequest(
        request_id=request_id,
        resources_server=server,
        completion=completion,
        row_json=json.dumps(ROW),
        **fields,
    )


def script(proxy: FaultProxy, cases: dict) -> None:
    """Each case's reply for the items whose completion is `case-<name>`."""
    proxy.set_faults(
        *(
            Fault("status", match=f'"case-{name}"', body=json.dumps(value[0]).encode())
            for name, value in cases.items()
        )
    )


@pytest.fixture
def proxy():
    with FaultProxy(None) as running:
        yield running


def test_0_7_replies_keep_valid_rewards_and_mask_the_rest(start_bridge, proxy):
    script(proxy, {**SCORED_07, **MASKED_07})
    bridge = start_bridge("--server", f"scripted={proxy.url}")
    items = [item(f"id-{name}", f"case-{name}") for name in [*SCORED_07, *MASKED_07]]
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        results = scored(stub, items)
        unary = stub.Verify(item("unary-A", "case-A"), timeout=30)
    for name, (reply, reward) in SCORED_07.items():
        result = results[f"id-{name}"]
        assert result.WhichOneof("outcome") == "reward", result.error.message
        assert result.reward == reward
        assert result.failure_kind == (reply.get("failure_kind") or "")
        assert result.failure_reason == (reply.get("failure_reason") or "")
    assert (unary.reward, unary.failure_kind) == (0.7, "judge_unparseable")
    for name, (_reply, code, reason, metadata, ending) in MASKED_07.items():
        result = results[f"id-{name}"]
        info = error_info(result)
        assert (result.error.code, info.reason) == (code, reason), name
        assert not result.failure_kind and not result.failure_reason  # they are in the error
        for key, value in metadata.items():
            assert info.metadata.get(key) == value, (name, key)
        assert info.metadata["attempts"] == "1"
        assert result.error.message.endswith(ending)
    assert all(proxy.attempts[f"id-{name}"] == 1 for name in MASKED_07)  # never retried


def test_an_empty_request_id_is_always_an_invalid_item(start_bridge, proxy):
    """Alone on a stream, twice on one stream (next to a good item) and on the unary Verify:
    the same INVALID_ARGUMENT each time, and nothing of theirs sent upstream."""
    script(proxy, SCORED_07)
    bridge = start_bridge("--server", f"scripted={proxy.url}")
    streams = [[item("", "case-A")], [item("", "case-A"), item("", "case-B"), item("x", "case-C")]]
    results = []
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        for items in streams:
            batch = verify_pb2.VerifyStreamRequest(items=items)
            for message in stub.VerifyStream(iter([batch]), timeout=30):
                results += list(message.results)
        results.append(stub.Verify(item("", "case-A"), timeout=30))
    good = [r for r in results if r.request_id == "x"]
    assert len(good) == 1 and good[0].reward == 1.0
    refused = [r for r in results if r.request_id == ""]
    assert len(refused) == 4
    for result in refused:
        info = error_info(result)
        assert (result.error.code, info.reason) == (code_pb2.INVALID_ARGUMENT, "INVALID_ITEM")
        assert (result.error.message, dict(info.metadata)) == (
            "request_id is empty",
            {"field": "request_id"},
        )
    assert proxy.total == 1  # only "x" reached the upstream


def test_an_unreachable_head_server_is_unavailable_with_its_own_reason(start_bridge, proxy):
    bridge = start_bridge(
        "--head-url", f"http://127.0.0.1:{closed_port()}", "--server", f"scripted={proxy.url}"
    )
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        result = stub.Verify(item("h", "case-A", server="mcqa"), timeout=30)
    info = error_info(result)
    assert (result.error.code, info.reason) == (code_pb2.UNAVAILABLE, "HEAD_SERVER_UNAVAILABLE")
    assert info.metadata["discoveryError"].startswith("ClientConnectorError")
    assert info.metadata["resourcesServer"] == "mcqa"


def test_timeout_seconds_bounds_each_upstream_call_not_the_whole_item(start_bridge, proxy):
    """A session item whose `/seed_session` and `/verify` take 0.6 s each scores with
    `timeout_seconds=1` (1.2 s in all); a `/seed_session` of 1.6 s fails alone, after 1 s."""
    proxy.set_faults(
        Fault("status", match='"response":{', body=b'{"reward": 1.0}', seconds=0.6),
        Fault("status", match='"slow-seed"', body=b"{}", seconds=1.6),
        Fault("status", body=b"{}", seconds=0.6),  # /seed_session
    )
    bridge = start_bridge("--server", f"scripted={proxy.url}", "--retry-attempts", "1")
    both = item("both", "fine", seed_session=True, timeout_seconds=1.0)
    slow = item("slow", "fine", seed_session=True, timeout_seconds=1.0)
    slow.prompt.add(role="user", content="slow-seed")  # in the seed body too
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        results = scored(stub, [both, slow])
    assert results["both"].reward == 1.0
    info = error_info(results["slow"])
    assert (results["slow"].error.code, info.reason) == (
        code_pb2.DEADLINE_EXCEEDED,
        "UPSTREAM_SESSION_FAILED",
    )
    assert info.metadata["timeoutSeconds"] == "1.000"
    assert info.metadata["upstreamUrl"].endswith("/seed_session")


def test_trl_gets_the_failure_kind_and_counts_degraded_items(start_bridge, proxy):
    """The reward function over a real bridge: valid degraded rewards kept (A, B), masked
    ones None (E, G), the kind and reason in the `nemo_gym/failure_kind` / `failure_reason`
    columns (a masked item's from its error), degraded_fraction."""
    cases = {name: SCORED_07[name] for name in ("A", "B", "D")}
    cases.update({name: MASKED_07[name] for name in ("E", "G")})
    script(proxy, cases)
    bridge = start_bridge("--server", f"scripted={proxy.url}")
    reward_fn = create_nemo_gym_reward_fn({}, {}, target=bridge.target, max_failure_fraction=1.0)
    metrics, columns = {}, {}
    rewards = reward_fn(
        completions=[f"case-{name}" for name in cases],
        resources_server_ref=[{"name": "scripted"}] * len(cases),
        log_metric=lambda name, value: metrics.setdefault(name, value),
        log_extra=lambda column, values: columns.setdefault(column, values),
    )
    assert rewards == [0.7, 0.0, 1.0, None, None]
    assert columns["nemo_gym/failure_kind"] == [
        "judge_unparseable",
        "usersim:assistant_timeout",
        None,
        None,
        "judge_failed",
    ]
    judge_failure = MASKED_07["G"][0]["failure_reason"]
    assert columns["nemo_gym/failure_reason"] == [
        None,
        "assistant model timed out",
        None,
        None,
        judge_failure,
    ]
    assert columns["nemo_gym/error"] == [
        None,
        None,
        None,
        "UNKNOWN (UPSTREAM_MASKED_SAMPLE)",
        "UNAVAILABLE (UPSTREAM_JUDGE_FAILED)",
    ]
    assert metrics["rewards/nemo_gym/degraded_fraction"] == pytest.approx(2 / 5)
    assert metrics["rewards/nemo_gym/failed_fraction"] == pytest.approx(2 / 5)


@pytest.mark.nemo_gym_07
def test_real_0_7_mcqa_success_replies_still_score(nemo_gym, bridge_target):
    """Real NeMo Gym 0.7 mcqa: every reply carries `mask_sample: false, failure_kind: null,
    failure_reason: null`; right answers score 1.0, wrong ones 0.0, with no diagnostics."""
    rows = example_rows("mcqa", nemo_gym.venv)
    items = []
    for i, row in enumerate(rows):
        right, wrong = row["expected_answer"], wrong_letter(row["expected_answer"])
        items.append(mcqa_item(f"right-{i}", row, right, include_reply=True))
        items.append(mcqa_item(f"wrong-{i}", row, wrong, include_reply=True))
    with grpc.insecure_channel(bridge_target) as channel:
        results = scored(verify_pb2_grpc.VerifyServiceStub(channel), items)
    for request_id, result in results.items():
        assert result.WhichOneof("outcome") == "reward", result.error.message
        assert result.reward == (1.0 if request_id.startswith("right") else 0.0)
        assert (result.failure_kind, result.failure_reason) == ("", "")
        reply = json.loads(result.reply_json)
        assert (reply["mask_sample"], reply["failure_kind"], reply["failure_reason"]) == (
            False,
            None,
            None,
        )
