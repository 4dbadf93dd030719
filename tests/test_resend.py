"""What a broken stream leaves to send again (rewards/client/resend.py), without a bridge: only
UNAVAILABLE counts as broken; a VerifyStream sends every unanswered item again, a RunStream
only those gRPC never took; at most MAX_STREAMS streams and only while time is left. The real
thing (bridges SIGKILLed mid-call): tests/test_redispatch.py."""

from __future__ import annotations

import pytest

from nemo_gym_grpc.rewards.client import resend
from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.v1 import rollout_pb2

BROKEN = Failure("UNAVAILABLE", None, "Socket closed")


def _items(count: int) -> list[rollout_pb2.RunRequest]:
    return [rollout_pb2.RunRequest(request_id=f"r{i}", agent="a") for i in range(count)]


def _take(streams: resend.Streams, messages: int) -> None:
    """gRPC pulls the first `messages` messages of the current stream."""
    pulled = streams.messages(lambda chunk: chunk)
    for _ in range(messages):
        next(pulled)


def _ids(items: list[rollout_pb2.RunRequest]) -> list[str]:
    return [item.request_id for item in items]


@pytest.mark.parametrize(
    "failure",
    [None, Failure("DEADLINE_EXCEEDED", None, "late"), Failure("UNAUTHENTICATED", None, "no")],
)
def test_only_a_broken_stream_is_sent_again(failure):
    streams = resend.Streams(_items(3), resend_taken=True)
    _take(streams, 1)
    assert streams.after_break(failure, _items(3), 10.0) == ([], [])
    assert streams.count == 1


def test_a_verify_stream_sends_every_unanswered_item_again():
    items = _items(200)
    streams = resend.Streams(items, resend_taken=True)
    _take(streams, 4)  # all 200 taken (64 + 64 + 64 + 8)
    again, kept = streams.after_break(BROKEN, items[150:], 10.0)
    assert _ids(again) == _ids(items[150:]) and kept == []
    assert streams.pending == again and streams.count == 2 and streams.taken == set()


def test_a_run_stream_sends_again_only_the_items_grpc_never_took():
    items = _items(200)
    streams = resend.Streams(items, resend_taken=False)
    _take(streams, 2)  # the first 128 taken: their /run may have started
    again, kept = streams.after_break(BROKEN, items[100:], 10.0)
    assert _ids(kept) == _ids(items[100:128]) and _ids(again) == _ids(items[128:])


def test_no_more_than_max_streams_and_none_without_time_left():
    items = _items(10)
    streams = resend.Streams(items, resend_taken=True)
    for _ in range(resend.MAX_STREAMS - 1):
        _take(streams, 1)
        assert streams.after_break(BROKEN, items, 10.0)[0] == items
    _take(streams, 1)
    assert streams.after_break(BROKEN, items, 10.0) == ([], [])  # the last stream was the 3rd
    late = resend.Streams(items, resend_taken=True)
    assert late.after_break(BROKEN, items, 0.0) == ([], [])


def test_a_run_stream_whose_unanswered_items_were_all_taken_is_over():
    items = _items(10)
    streams = resend.Streams(items, resend_taken=False)
    _take(streams, 1)
    assert streams.after_break(BROKEN, items[5:], 10.0) == ([], items[5:])
