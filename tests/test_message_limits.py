"""Messages the bridge refuses as a whole: too many items in one VerifyStreamRequest
(`--max-batch-items`) and a unary Verify that cannot be parsed (invalid UTF-8)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support.items import mcqa_item, mcqa_row


def test_a_message_over_max_batch_items_ends_the_stream_naming_the_flag(start_bridge, nemo_gym):
    bridge = start_bridge("--head-url", nemo_gym.head_url, "--max-batch-items", "8")
    answered = threading.Event()

    def messages():
        yield verify_pb2.VerifyStreamRequest(items=[mcqa_item(f"ok{i}") for i in range(8)])
        answered.wait(30)
        yield verify_pb2.VerifyStreamRequest(items=[mcqa_item(f"big{i}") for i in range(9)])
        yield verify_pb2.VerifyStreamRequest(items=[mcqa_item("after")])

    results = {}
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        with pytest.raises(grpc.RpcError) as ended:
            for message in stub.VerifyStream(messages(), timeout=60):
                results.update({r.request_id: r for r in message.results})
                if len(results) == 8:
                    answered.set()
        assert stub.Verify(mcqa_item("still-serves"), timeout=30).reward == 1.0
    assert sorted(results) == sorted(f"ok{i}" for i in range(8))
    assert all(r.reward == 1.0 for r in results.values())
    assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = ended.value.details()
    assert "held 9 items" in details and "limit is 8" in details and "--max-batch-items" in details


def test_a_unary_verify_with_invalid_utf8_is_invalid_argument(bridge_target):
    """Proto3 strings must be valid UTF-8. gRPC's own parser would end such a call UNKNOWN
    before any handler runs; the bridge parses Verify itself and answers INVALID_ARGUMENT."""
    marker = "REPLACEDBYINVALIDUTF8"
    raw = mcqa_item("broken", completion=marker).SerializeToString()
    raw = raw.replace(marker.encode(), b"\xff\xfe" + b"x" * (len(marker) - 2))
    with grpc.insecure_channel(bridge_target) as channel:
        verify = channel.unary_unary(
            "/nemo_gym_grpc.v1.VerifyService/Verify",
            request_serializer=lambda message: message,
            response_deserializer=verify_pb2.VerifyResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as refused:
            verify(raw, timeout=30)
        assert verify(mcqa_item("fine").SerializeToString(), timeout=30).reward == 1.0
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be parsed" in refused.value.details() and "UTF-8" in refused.value.details()


def test_results_that_finish_together_go_out_under_the_message_limit(start_bridge, nemo_gym):
    # Each result echoes its row's ~200 KB padding (include_reply); the client reads slowly, so
    # the results pile up behind the first while it is being written: together they are over
    # the bridge's 1 MiB send limit. They go out in several messages, none over it; before, the
    # one big message ended the stream RESOURCE_EXHAUSTED with 11 of 12 results lost.
    limit = 1024 * 1024
    bridge = start_bridge("--head-url", nemo_gym.head_url, "--max-message-mb", "1")
    row = dict(mcqa_row(), expected_answer="p" * 200_000)  # mcqa echoes it; it scores 0.0
    items = [mcqa_item(f"big{i}", row, answer="B", include_reply=True) for i in range(12)]
    requests = [verify_pb2.VerifyStreamRequest(items=[item]) for item in items]
    results, sizes, counts = {}, [], []
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        for message in stub.VerifyStream(iter(requests), timeout=120):
            sizes.append(message.ByteSize())
            counts.append(len(message.results))
            results.update({r.request_id: r for r in message.results})
            time.sleep(0.3)  # a slow reader
    assert sorted(results) == sorted(item.request_id for item in items)
    # (mcqa echoes expected_answer upper-cased, and boxes no such letter: 0.0)
    assert all(r.reward == 0.0 and "P" * 200_000 in r.reply_json for r in results.values())
    assert max(sizes) <= limit and sum(sizes) > limit
    assert max(counts) > 1, f"no results piled up behind a write: {counts}"
