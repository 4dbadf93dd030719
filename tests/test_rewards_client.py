"""The reward client's handling of what a real bridge never does, over real gRPC on loopback.

A scripted in-process VerifyService (tests/support/scripted_bridge.py) plays a bridge that
breaks the VerifyStream contract (unknown or duplicate request_ids, unanswered items), fails
the whole stream, stalls, or answers out of order. These cases cannot be produced with the
real bridge; everything the real bridge does is tested against it in test_rewards*.py. Each
case runs through the sync reward function (grpcio) and its async form (grpc.aio). Also here:
no bridge at all.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest

from nemo_gym_grpc.rewards import (
    ScoringError,
    create_nemo_gym_reward_fn,
    reward_nemo_gym_verify,
    reward_nemo_gym_verify_async,
)
from nemo_gym_grpc.rewards.client import (
    channels,
    embedded,
    outcomes,
    resend,
    settings,
    stopping,
    stream,
)
from nemo_gym_grpc.rewards.client.stream import Route
from nemo_gym_grpc.rewards.tools import batches, scorefile
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port
from tests.support.scripted_bridge import ScriptedBridge
from tests.support.waiting import wait_until


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
    with pytest.raises(outcomes.ProtocolError, match=match):
        _call(target, mode, 5, asynchronous)


def test_a_broken_stream_is_sent_again_then_what_is_left_fails_with_its_cause(
    scripted, caplog, asynchronous
):
    # each stream answers half of its items, then ends UNAVAILABLE: 6 -> 3 left, sent again
    # -> 2 left, sent again -> 1 left after the third and last stream, failed with the cause
    target, servicer = scripted
    before = servicer.streams.get("abort", 0)
    with caplog.at_level(logging.WARNING, logger="nemo_gym_grpc.rewards"):
        rewards = _call(target, "abort", 6, asynchronous)
    assert servicer.streams["abort"] - before == resend.MAX_STREAMS == 3
    assert rewards == [0.0, 1.0, 2.0, 3.0, 4.0, None]
    assert "its 3 unanswered items go out again (stream 2 of 3)" in caplog.text
    assert "its 2 unanswered items go out again (stream 3 of 3)" in caplog.text
    assert "1 of 6 items failed" in caplog.text
    assert "UNAVAILABLE (BRIDGE_DRAINING) x1" in caplog.text


def test_the_batch_deadline_ends_a_stalled_stream(scripted, caplog, asynchronous):
    target, _ = scripted
    with caplog.at_level(logging.WARNING, logger="nemo_gym_grpc.rewards"):
        rewards = _call(target, "stall", 4, asynchronous, batch_timeout=1.0)
    assert rewards == [0.0, 1.0, None, None]
    assert "DEADLINE_EXCEEDED x2" in caplog.text


def _verify_call(target: str, mode: str, count: int, name: str = "") -> stream.Call:
    """A call of `count` items to scripted `mode`, request_ids "<name or mode>-<i>"."""
    name = name or mode
    requests = [
        verify_pb2.VerifyRequest(request_id=f"{name}-{i}", resources_server=mode, completion=str(i))
        for i in range(count)
    ]
    return stream.Call(stream.VERIFY, target, requests, timeout=120.0, connect_timeout=10.0)


def test_a_stopper_ends_a_sync_call_from_another_thread_with_one_outcome_per_item(scripted):
    target, servicer = scripted
    stopper, outcomes_of = stopping.Stopper(), {}
    # two answered, then nothing for 60 s (ids of its own: an earlier test's stalled call may
    # end on the servicer while this one runs)
    call = _verify_call(target, "stall", 4, name="stopped")

    def send() -> None:
        with stopper.running():
            outcomes_of.update(stream.send(call))

    reader = threading.Thread(target=send)
    reader.start()
    wait_until(lambda: len(call.outcomes) == 2, 10, "the answered half")
    stopper.stop()
    reader.join(10)
    assert not reader.is_alive()
    assert [outcomes_of[f"stopped-{i}"].reward for i in (0, 1)] == [0.0, 1.0]
    for held in ("stopped-2", "stopped-3"):
        failure = outcomes_of[held]
        assert isinstance(failure, outcomes.Failure)
        assert (failure.code, failure.whole_call) == ("CANCELLED", True)
    wait_until(lambda: "stopped-0" in servicer.stalls_ended, 10, "the bridge's cancel")
    # once stopped, a call made under it is cancelled as it opens: each item CANCELLED
    with stopper.running():
        later = stream.send(_verify_call(target, "echo", 2))
    assert {failure.code for failure in later.values()} == {"CANCELLED"}  # type: ignore[union-attr]


_FORK_DURING_A_CALL = """
import os, signal, sys, threading, time
from nemo_gym_grpc.rewards.client import stopping, stream
from nemo_gym_grpc.v1 import verify_pb2
items = [verify_pb2.VerifyRequest(request_id=str(i), resources_server="stall") for i in range(2)]
call = stream.Call(stream.VERIFY, sys.argv[1], items, timeout=60.0, connect_timeout=10.0)
stopper = stopping.Stopper()
def read():
    with stopper.running():
        stream.send(call)
reader = threading.Thread(target=read)
reader.start()
while not call.outcomes:  # the stalled call is being read
    time.sleep(0.01)
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    time.sleep(0.2)  # the child may hang in gRPC's fork handler: the hazard warned about
    if os.waitpid(pid, os.WNOHANG) == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
stopper.stop()
reader.join(10)
"""


def test_a_fork_while_another_thread_reads_a_call_is_warned_about_once(scripted):
    target, _ = scripted
    done = subprocess.run(
        [sys.executable, "-c", _FORK_DURING_A_CALL, target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("forks while 1 NeMo Gym gRPC call(s) are read") == 1, done.stderr


def test_an_item_over_the_message_limit_fails_alone(scripted, caplog, asynchronous):
    target, _ = scripted
    huge = "1" + " " * stream.MAX_MESSAGE_BYTES
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
    monkeypatch.setenv(settings.CONNECT_TIMEOUT_ENV, "0.2")
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
# the transport itself: outcomes keyed by request_id


@pytest.mark.parametrize("asynchronous", [False, True])
def test_verify_batch_returns_one_outcome_per_request_id(scripted, asynchronous):
    target, _ = scripted
    ids = ["a", "too-big", "b", "c"]
    requests = [
        verify_pb2.VerifyRequest(request_id=i, resources_server="echo", completion=c)
        for i, c in zip(ids, ["1", "1" + " " * stream.MAX_MESSAGE_BYTES, "2", "3"], strict=True)
    ]
    call = stream.Call(stream.VERIFY, target, requests, timeout=30, connect_timeout=10)
    sent = asyncio.run(stream.asend(call)) if asynchronous else stream.send(call)
    assert sorted(sent) == sorted(ids)
    assert [sent[i].reward for i in ("a", "b", "c")] == [1.0, 2.0, 3.0]
    assert (sent["too-big"].code, sent["too-big"].reason) == ("INVALID_ARGUMENT", "ITEM_TOO_LARGE")
    with pytest.raises(ValueError, match="duplicate request_id 'a'"):
        stream.Call(stream.VERIFY, target, requests[:1] * 2, timeout=30, connect_timeout=10)


# --------------------------------------------------------------------------------------------
# the score command's FileScorer (one event loop) against the scripted bridge


def _rows(modes: list[str]) -> list[scorefile.Row]:
    """One score input row per mode (routed to that scripted mode), lines 1..n."""
    rows = []
    for line, mode in enumerate(modes, start=1):
        raw = json.dumps({"resources_server_ref": {"name": mode}, "response": {}}).encode()
        rows.append(scorefile.parse_row(raw, line, None, 0.0))
    return rows


def _file_scorer(target: str, stop: asyncio.Event, concurrency: int = 2) -> batches.FileScorer:
    route = Route(target, embedded.head_server_spec, channels.PLAINTEXT, 30, 10)
    return batches.FileScorer(route, concurrency=concurrency, stop=stop)


def _ended(servicer: ScriptedBridge, since: int) -> set[str]:
    """The first request_ids of the stalled calls that ended since `since` (the length of
    `stalls_ended` before): ids, not a count, since an earlier test's call may end meanwhile."""
    return set(servicer.stalls_ended[since:])


def test_a_stopped_run_keeps_the_finished_batches_and_cancels_the_calls_in_flight(scripted):
    target, servicer = scripted
    out = io.BytesIO()
    written: list[int] = []
    rows = _rows(["echo"] * 4 + ["stall"] * 8)  # batches of 2: two answered, four held
    ended_before = len(servicer.stalls_ended)  # the stalls of this test are lines 5 and 7
    servicer.most_in_flight = 0

    async def run_stopped_after_one_second() -> tuple[bool, int]:
        stop = asyncio.Event()
        scorer = _file_scorer(target, stop)
        asyncio.get_running_loop().call_later(1.0, stop.set)
        complete = await scorer.run(iter(rows), 2, out, lambda r: written.append(len(r)))
        return complete, scorer.written

    assert asyncio.run(run_stopped_after_one_second()) == (False, 4)
    assert [json.loads(line)["line"] for line in out.getvalue().splitlines()] == [1, 2, 3, 4]
    assert written == [2, 2]
    # the bridge saw both held calls cancelled
    wait_until(lambda: _ended(servicer, ended_before) >= {"5", "7"}, 10, "cancelled calls")
    assert servicer.most_in_flight == 2  # --concurrency: the other two held batches waited


async def test_a_call_that_keeps_failing_as_a_whole_stops_the_run_after_three_attempts(
    scripted, monkeypatch
):
    target, _ = scripted
    monkeypatch.setattr(batches, "CALL_BACKOFF", 0.01)  # the attempts are the point, not the wait
    out = io.BytesIO()
    scorer = _file_scorer(target, asyncio.Event())
    with pytest.raises(batches.NoVerdict, match=r"\(3 attempts\): UNAVAILABLE \(BRIDGE_DRAINING\)"):
        await scorer.run(iter(_rows(["abort"] * 4)), 4, out, lambda r: None)
    assert out.getvalue() == b""  # nothing of a failed batch is written


@pytest.mark.parametrize(("mode", "attempts"), [("unroutable", 1), ("headless", 3)])
async def test_rows_without_a_verdict_stop_the_run_and_only_the_batches_before_are_written(
    scripted, monkeypatch, mode, attempts
):
    # was: written as finished rows (exit 0), so a rerun skipped them
    target, servicer = scripted
    monkeypatch.setattr(batches, "CALL_BACKOFF", 0.01)
    out = io.BytesIO()
    scorer = _file_scorer(target, asyncio.Event(), concurrency=1)  # one batch after another
    before = servicer.streams.get(mode, 0)
    cause = "NOT_FOUND (UNKNOWN_RESOURCES_SERVER)" if mode == "unroutable" else "UNAVAILABLE"
    with pytest.raises(batches.NoVerdict) as stopped:
        await scorer.run(iter(_rows(["echo"] * 2 + [mode] * 2 + ["echo"] * 2)), 2, out, print)
    assert str(stopped.value).startswith(f"2 rows got no verdict ({attempts} attempt")
    assert f": {cause}" in str(stopped.value)
    assert [json.loads(line)["line"] for line in out.getvalue().splitlines()] == [1, 2]
    assert servicer.streams[mode] - before == attempts  # sent again only while it may help


def test_score_fails_at_once_when_the_target_refuses_the_connection(tmp_path):
    # was: it waited NEMO_GYM_GRPC_CONNECT_TIMEOUT (60 s by default) for a port nothing listens on
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"resources_server_ref": {"name": "echo"}, "response": {}}\n')
    out = tmp_path / "out.jsonl"
    target = f"127.0.0.1:{closed_port()}"
    command = [sys.executable, "-m", "nemo_gym_grpc.cli", "score", str(rows)]
    command += ["-o", str(out), "--target", target, "--no-progress"]
    env = {**os.environ, settings.CONNECT_TIMEOUT_ENV: "600"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    refused = f"cannot connect to the bridge at {target} (refused?; a bridge serving TLS needs "
    assert f"nemo-gym-grpc score: {refused}{settings.CA_ENV})" in done.stderr
    assert not out.exists() or out.read_text() == ""


def test_sigterm_stops_the_score_command_with_a_valid_prefix(scripted, tmp_path):
    target, servicer = scripted
    modes = ["echo"] * 4 + ["stall"] * 4  # batches of 2: two answered, two held
    rows = "".join(
        json.dumps({"resources_server_ref": {"name": m}, "response": {}}) + "\n" for m in modes
    )
    (tmp_path / "rows.jsonl").write_text(rows)
    out = tmp_path / "out.jsonl"
    ended_before = len(servicer.stalls_ended)
    command = [
        sys.executable,
        "-m",
        "nemo_gym_grpc.cli",
        "score",
        str(tmp_path / "rows.jsonl"),
    ]
    command += ["-o", str(out), "--target", target, "--batch-size", "2", "--no-progress"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(
            lambda: out.exists() and out.read_bytes().count(b"\n") == 4 and servicer.in_flight == 2,
            60,
            "4 rows written and 2 calls held",
        )
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert "SIGTERM: stopping" in stderr and "Traceback" not in stderr
    assert [json.loads(line)["line"] for line in out.read_text().splitlines()] == [1, 2, 3, 4]
    assert "4 of 8 rows in" in stdout
    wait_until(lambda: _ended(servicer, ended_before) >= {"5", "7"}, 10, "cancelled calls")
