"""The bridge end to end: real gRPC over loopback, real NeMo Gym resources servers behind it."""

from __future__ import annotations

import json

import grpc
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port, example_rows
from tests.support.items import error_info, mcqa_item, wrong_letter

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)


@pytest.fixture(scope="module")
def stub(bridge_target):
    with grpc.insecure_channel(bridge_target) as channel:
        yield verify_pb2_grpc.VerifyServiceStub(channel)


def test_unary_verify_scores_right_and_wrong_mcqa_answers(stub):
    row = example_rows("mcqa")[0]
    right = stub.Verify(mcqa_item("r", row, row["expected_answer"]), timeout=30)
    wrong = stub.Verify(mcqa_item("w", row, wrong_letter(row["expected_answer"])), timeout=30)
    assert not right.HasField("error") and not wrong.HasField("error")
    assert (right.request_id, right.reward) == ("r", 1.0)
    assert (wrong.request_id, wrong.reward) == ("w", 0.0)
    assert wrong.WhichOneof("outcome") == "reward"  # 0.0 is a reward, set explicitly
    assert right.latency_seconds > 0


def test_stream_of_256_items_gives_each_request_id_its_own_reward(stub):
    rows = example_rows("mcqa")
    expected: dict[str, float] = {}
    batches = []
    for b in range(4):
        items = []
        for i in range(64):
            row = rows[(b * 64 + i) % len(rows)]
            right = (b * 64 + i) % 3 != 0
            answer = row["expected_answer"] if right else wrong_letter(row["expected_answer"])
            request_id = f"item-{b * 64 + i}"
            expected[request_id] = 1.0 if right else 0.0
            items.append(mcqa_item(request_id, row, answer))
        batches.append(verify_pb2.VerifyStreamRequest(items=items))

    got: dict[str, float] = {}
    for message in stub.VerifyStream(iter(batches), timeout=120):
        for result in message.results:
            assert not result.HasField("error"), result.error.message
            assert result.request_id not in got
            got[result.request_id] = result.reward
    assert got == expected


def test_unknown_resources_server_is_a_not_found_item_error_naming_known_servers(stub):
    result = stub.Verify(
        verify_pb2.VerifyRequest(request_id="u", resources_server="no_such_server"), timeout=30
    )
    assert result.error.code == code_pb2.NOT_FOUND
    assert error_info(result).reason == "UNKNOWN_RESOURCES_SERVER"
    assert "mcqa" in result.error.message and "no_such_server" in result.error.message
    assert result.WhichOneof("outcome") == "error" and not result.HasField("reward")
    assert not result.reward_components


def test_an_unreadable_head_server_is_unavailable_not_an_unknown_name(start_bridge):
    head_url = f"http://127.0.0.1:{closed_port()}"
    bridge = start_bridge("--head-url", head_url)
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        result = stub.Verify(
            verify_pb2.VerifyRequest(request_id="h", resources_server="mcqa"), timeout=30
        )
    assert result.error.code == code_pb2.UNAVAILABLE  # issue 10: was NOT_FOUND
    assert error_info(result).reason == "HEAD_SERVER_UNAVAILABLE"
    assert f"the head server {head_url} could not be read: " in result.error.message
    assert "Connect" in error_info(result).metadata["discoveryError"]


def test_upstream_that_is_down_gives_unavailable_not_a_reward(start_bridge):
    bridge = start_bridge("--server", f"down=http://127.0.0.1:{closed_port()}")
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        items = [
            verify_pb2.VerifyRequest(request_id=str(i), resources_server="down", completion="x")
            for i in range(8)
        ]
        results = [
            r
            for m in stub.VerifyStream(iter([verify_pb2.VerifyStreamRequest(items=items)]), 30)
            for r in m.results
        ]
    assert sorted(r.request_id for r in results) == sorted(str(i) for i in range(8))
    for result in results:
        assert result.error.code == code_pb2.UNAVAILABLE
        info = error_info(result)
        assert info.reason == "UPSTREAM_UNAVAILABLE"
        assert info.metadata["upstreamUrl"].endswith("/verify")


def test_typed_prompt_form_and_reply_fields(stub):
    row = dict(example_rows("mcqa")[0])
    question = row.pop("responses_create_params")["input"][0]["content"]
    request = verify_pb2.VerifyRequest(
        request_id="typed",
        resources_server="mcqa",
        prompt=[verify_pb2.Message(role="user", content=question)],
        completion=f"\\boxed{{{row['expected_answer']}}}",
        model="my-policy",
        row_json=json.dumps(row),
        include_reply=True,
    )
    result = stub.Verify(request, timeout=30)
    assert result.reward == 1.0, result.error.message
    reply = json.loads(result.reply_json)
    assert reply["expected_answer"] == reply["extracted_answer"] == row["expected_answer"]
    assert "response" not in reply and "reward" not in reply


def test_full_fidelity_response_json_on_equivalence_rule(stub):
    row = example_rows("equivalence_rule")[0]
    response = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "policy",
        "output": [
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": row["expected_answer"], "annotations": []}
                ],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    request = verify_pb2.VerifyRequest(
        request_id="eq",
        resources_server="equivalence_rule",
        row_json=json.dumps(row),
        response_json=json.dumps(response),
    )
    assert stub.Verify(request, timeout=30).reward == 1.0


def test_upstream_422_is_invalid_argument_with_http_status(stub):
    row = dict(example_rows("equivalence_rule")[0])
    del row["expected_answer"]  # required by the server's request model
    result = stub.Verify(
        verify_pb2.VerifyRequest(
            request_id="bad", resources_server="equivalence_rule", row_json=json.dumps(row)
        ),
        timeout=30,
    )
    assert result.error.code == code_pb2.INVALID_ARGUMENT
    info = error_info(result)
    assert (info.reason, info.metadata["httpStatus"]) == ("UPSTREAM_HTTP_ERROR", "422")
    assert "expected_answer" in result.error.message


def test_upstream_500_is_internal(stub):
    row = dict(example_rows("reasoning_gym")[0])
    row["metadata"] = {}  # reasoning_gym raises without metadata.source_dataset
    result = stub.Verify(
        verify_pb2.VerifyRequest(
            request_id="boom", resources_server="reasoning_gym", row_json=json.dumps(row)
        ),
        timeout=30,
    )
    assert result.error.code == code_pb2.INTERNAL
    assert error_info(result).metadata["httpStatus"] == "500"


def test_bad_item_fails_alone_and_the_rest_of_the_batch_is_scored(stub):
    row = example_rows("mcqa")[0]
    items = [
        mcqa_item("good", row, row["expected_answer"]),
        verify_pb2.VerifyRequest(request_id="not-json", resources_server="mcqa", row_json="{"),
        verify_pb2.VerifyRequest(request_id="list", resources_server="mcqa", response_json="[]"),
        verify_pb2.VerifyRequest(request_id="no-route", completion="x"),
    ]
    stream = stub.VerifyStream(iter([verify_pb2.VerifyStreamRequest(items=items)]), timeout=30)
    results = {r.request_id: r for m in stream for r in m.results}
    assert results["good"].reward == 1.0 and not results["good"].HasField("error")
    for request_id in ("not-json", "list", "no-route"):
        assert results[request_id].error.code == code_pb2.INVALID_ARGUMENT
        assert error_info(results[request_id]).reason == "INVALID_ITEM"


def test_list_resources_servers_shows_discovered_upstreams(stub, nemo_gym):
    listed = stub.ListResourcesServers(
        verify_pb2.ListResourcesServersRequest(refresh=True), timeout=30
    )
    by_name = {s.name: s for s in listed.resources_servers}
    for name, url in nemo_gym.server_urls.items():
        assert list(by_name[name].upstream_urls) == [url]
        assert by_name[name].source == "head_server"
