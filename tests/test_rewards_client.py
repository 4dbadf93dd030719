"""The reward client's handling of what a real bridge never does, over real gRPC on loopback.

A scripted in-process VerifyService plays a bridge that breaks the VerifyStream contract
(unknown or duplicate request_ids, unanswered items), fails the whole stream, stalls, or
answers out of order. These cases cannot be produced with the real bridge; everything the real
bridge does is tested against it in test_rewards.py. Each case runs through the sync reward
function (grpcio) and its async form (grpc.aio). Also here: no bridge at all, and embedded
bridges that cannot start (real subprocesses).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent import futures

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from nemo_gym_grpc.rewards import (
    ScoringError,
    client,
    create_nemo_gym_reward_fn,
    embedded,
    reward_nemo_gym_verify,
    reward_nemo_gym_verify_async,
    settings,
)
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port


class ScriptedBridge(verify_pb2_grpc.VerifyServiceServicer):
    """Answers each VerifyStream according to the `resources_server` of its first item.

    echo: reward = the number in the completion, results in reverse order; unknown: one
    result for an id never sent; duplicate: the first item answered twice; short: all but one
    answered, then OK; abort: half answered, then UNAVAILABLE with an ErrorInfo reason;
    stall: half answered, then nothing until the client gives up.
    """

    def __init__(self) -> None:
        self.message_sizes: list[int] = []

    def VerifyStream(self, request_iterator, context):
        items = []
        for message in request_iterator:
            self.message_sizes.append(len(message.items))
            items.extend(message.items)
        if not items:
            return
        mode = items[0].resources_server
        results = [
            verify_pb2.VerifyResponse(request_id=r.request_id, reward=float(r.completion or 0))
            for r in items
        ]
        half = len(results) // 2
        if mode == "echo":
            yield verify_pb2.VerifyStreamResponse(results=results[::-1])
        elif mode == "unknown":
            yield verify_pb2.VerifyStreamResponse(
                results=[verify_pb2.VerifyResponse(request_id="never-sent")]
            )
        elif mode == "duplicate":
            yield verify_pb2.VerifyStreamResponse(results=[results[0], *results])
        elif mode == "short":
            yield verify_pb2.VerifyStreamResponse(results=results[:-1])
        elif mode == "abort":
            yield verify_pb2.VerifyStreamResponse(results=results[:half])
            info = any_pb2.Any()
            info.Pack(error_details_pb2.ErrorInfo(reason="BRIDGE_DRAINING", domain="test"))
            context.abort_with_status(
                rpc_status.to_status(
                    status_pb2.Status(
                        code=code_pb2.UNAVAILABLE, message="shutting down", details=[info]
                    )
                )
            )
        elif mode == "stall":
            yield verify_pb2.VerifyStreamResponse(results=results[:half])
            stopped = threading.Event()
            context.add_callback(stopped.set)
            stopped.wait(60)


@pytest.fixture(scope="module")
def scripted():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = ScriptedBridge()
    verify_pb2_grpc.add_VerifyServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


@pytest.fixture(params=["sync", "async"])
def asynchronous(request) -> bool:
    """Run the case through the sync reward function and through its async form."""
    return request.param == "async"


def _run(reward_fn, **kwargs):
    """Call a reward function, sync or async (then in a fresh event loop)."""
    result = reward_fn(**kwargs)
    return asyncio.run(result) if asyncio.iscoroutine(result) else result


def _call(target, mode, count, asynchronous, *, batch_timeout=30.0):
    reward_fn = create_nemo_gym_reward_fn(
        {},
        {},
        target=target,
        batch_timeout=batch_timeout,
        verify_timeout=5,
        asynchronous=asynchronous,
    )
    return _run(
        reward_fn,
        completions=[str(i) for i in range(count)],
        resources_server_ref=[{"name": mode}] * count,
    )


def test_results_are_put_back_in_input_order_and_sent_in_messages_of_64(scripted, asynchronous):
    target, servicer = scripted
    servicer.message_sizes.clear()
    assert _call(target, "echo", 130, asynchronous) == [float(i) for i in range(130)]
    assert servicer.message_sizes == [64, 64, 2]


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        ("unknown", "unknown request_id 'never-sent'"),
        ("duplicate", "duplicate request_id"),
        ("short", "ended VerifyStream OK with 1 of 5 items unanswered"),
    ],
)
def test_results_that_do_not_match_the_items_raise(scripted, mode, match, asynchronous):
    target, _ = scripted
    with pytest.raises(client.ProtocolError, match=match):
        _call(target, mode, 5, asynchronous)


def test_a_stream_failing_as_a_whole_fails_every_unanswered_item_with_its_cause(
    scripted, caplog, asynchronous
):
    target, _ = scripted
    with caplog.at_level(logging.WARNING, logger="nemo_gym_grpc.rewards"):
        rewards = _call(target, "abort", 6, asynchronous)
    assert rewards == [0.0, 1.0, 2.0, None, None, None]
    assert "3 of 6 items failed" in caplog.text
    assert "UNAVAILABLE (BRIDGE_DRAINING) x3" in caplog.text


def test_the_batch_deadline_ends_a_stalled_stream(scripted, caplog, asynchronous):
    target, _ = scripted
    with caplog.at_level(logging.WARNING, logger="nemo_gym_grpc.rewards"):
        rewards = _call(target, "stall", 4, asynchronous, batch_timeout=2.0)
    assert rewards == [0.0, 1.0, None, None]
    assert "DEADLINE_EXCEEDED x2" in caplog.text


def test_an_item_over_the_message_limit_fails_alone(scripted, caplog, asynchronous):
    target, _ = scripted
    huge = "1" + " " * client.MAX_MESSAGE_BYTES
    reward_fn = create_nemo_gym_reward_fn({}, {}, target=target, asynchronous=asynchronous)
    with caplog.at_level(logging.WARNING, logger="nemo_gym_grpc.rewards"):
        rewards = _run(
            reward_fn, completions=["2", huge, "3"], resources_server_ref=[{"name": "echo"}] * 3
        )
    assert rewards == [2.0, None, 3.0]
    assert "INVALID_ARGUMENT (ITEM_TOO_LARGE) x1" in caplog.text


def test_no_bridge_at_the_target_fails_every_item_and_the_guard_raises(
    monkeypatch, caplog, asynchronous
):
    monkeypatch.setenv(settings.TARGET_ENV, f"127.0.0.1:{closed_port()}")
    monkeypatch.setenv(settings.CONNECT_TIMEOUT_ENV, "0.5")
    reward_fn = reward_nemo_gym_verify_async if asynchronous else reward_nemo_gym_verify
    args = {
        "completions": ["a", "b", "c"],
        "resources_server_ref": [{"name": "mcqa"}] * 3,
        "verify_extra": [{}] * 3,
    }
    with pytest.raises(ScoringError) as raised:
        _run(reward_fn, **args)
    assert "3 of 3 items failed, more than max_failure_fraction=0.5" in str(raised.value)
    assert "UNAVAILABLE x3" in str(raised.value)
    assert "no connection to the bridge" in str(raised.value)

    monkeypatch.setenv(settings.MAX_FAILURE_FRACTION_ENV, "1")  # guard off: None per item
    with caplog.at_level(logging.WARNING, logger="nemo_gym_grpc.rewards"):
        assert _run(reward_fn, **args) == [None, None, None]
    assert "3 of 3 items failed" in caplog.text and "UNAVAILABLE x3" in caplog.text


# --------------------------------------------------------------------------------------------
# embedded bridges that cannot start (real subprocesses)


@pytest.fixture
def no_target(monkeypatch):
    monkeypatch.delenv(settings.TARGET_ENV, raising=False)
    yield
    embedded.stop_all()


def test_a_bridge_that_exits_at_startup_raises_with_its_stderr(no_target):
    reward_fn = create_nemo_gym_reward_fn({}, {"bad": "ftp://example/verify"})
    with pytest.raises(RuntimeError) as raised:
        reward_fn(completions=["x"], resources_server_ref=[{"name": "bad"}])
    message = str(raised.value)
    assert "exited with status 2" in message
    assert "expected NAME=http://HOST:PORT" in message  # the bridge CLI's own words
    assert not embedded.running_bridges()


def test_a_bridge_that_does_not_start_in_time_is_stopped(no_target, monkeypatch):
    monkeypatch.setenv(settings.STARTUP_TIMEOUT_ENV, "0.01")
    reward_fn = create_nemo_gym_reward_fn({}, {"x": "http://127.0.0.1:1/verify"})
    with pytest.raises(RuntimeError, match="did not start within 0.01 s") as raised:
        reward_fn(completions=["x"], resources_server_ref=[{"name": "x"}])
    pid = int(str(raised.value).split("(pid ")[1].split(")")[0])
    assert not os.path.exists(f"/proc/{pid}")  # stopped and reaped
    assert not embedded.running_bridges()
