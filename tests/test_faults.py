"""The fault matrix: every item sent gets exactly one outcome, a failure is never a reward,
nothing hangs past its bound, and the bridge keeps serving after each fault.

Real parts: a real NeMo Gym mcqa server behind a fault-injecting proxy
(tests/support/fault_proxy.py), a scripted upstream only for replies a real server cannot give
on demand, real bridge processes and real gRPC over loopback. Time bounds are generous (the
machine is shared) and only bound hangs; no case asserts speed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import aiohttp
import grpc
import pytest
import requests
from google.rpc import code_pb2

from nemo_gym_grpc.bridge.attempts import RetryPolicy
from nemo_gym_grpc.bridge.config import BridgeConfig
from nemo_gym_grpc.bridge.nemo_gym.verify import completion_response
from nemo_gym_grpc.bridge.upstreams import Upstreams
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port, start_bridge
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.items import Outcome, mcqa_row, scored, stream
from tests.support.items import error_info as info
from tests.support.items import mcqa_item as item
from tests.support.verifiers import verifier_for

MiB = 1024 * 1024
MAX_ITEM_BYTES = BridgeConfig().max_item_bytes
MARGIN = 5.0  # seconds of slack on every time bound


@pytest.fixture(scope="module")
def row() -> dict:
    return mcqa_row()


@pytest.fixture(scope="module")
def proxy(nemo_gym):
    """The fault proxy in front of the real mcqa server (the bridge's "mcqa")."""
    with FaultProxy(nemo_gym.server_urls["mcqa"]) as running:
        yield running


@pytest.fixture(scope="module")
def scripted():
    """A scripted upstream (the bridge's "scripted"); unmatched requests get HTTP 502."""
    with FaultProxy(None) as running:
        yield running


@pytest.fixture(scope="module")
def bridge(proxy, scripted):
    """One bridge for the whole matrix: it must keep serving after every fault."""
    with start_bridge(
        "--server",
        f"mcqa={proxy.url}",
        "--server",
        f"scripted={scripted.url}",
        "--server",
        f"down=http://127.0.0.1:{closed_port()}",
        "--health-interval",
        "600",
        "--max-in-flight",
        "64",
    ) as running:
        yield running


@pytest.fixture(autouse=True)
def no_faults(request):
    """Every test starts with no faults and zeroed counters on the module's upstreams."""
    for name in ("proxy", "scripted"):
        if name in request.fixturenames:
            request.getfixturevalue(name).set_faults()


def assert_failed(result, code: int, reason: str, **metadata: str) -> None:
    """`result` is a failure (never a reward) with this code, reason and metadata."""
    detail = info(result)
    assert (result.error.code, detail.reason) == (code, reason), result.error.message
    for key, value in metadata.items():
        assert detail.metadata[key] == value, (key, dict(detail.metadata))
    assert result.reward == 0.0 and not result.reward_components and not result.reply_json


def assert_rewarded(result, reward: float = 1.0) -> None:
    assert not result.HasField("error"), result.error.message
    assert result.reward == reward


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def assert_still_serves(stub, row, name: str = "after") -> None:
    results = scored(stub, [item(f"{name}-right", row), item(f"{name}-wrong", row, False)])
    assert_rewarded(results[f"{name}-right"], 1.0)
    assert_rewarded(results[f"{name}-wrong"], 0.0)


# --- the upstream cannot be reached or does not answer ------------------------------------


def test_refused_connections_fail_unavailable_after_three_attempts(stub, row):
    items = [item(f"r{i}", row, resources_server="down") for i in range(8)]
    outcome = stream(stub, items)
    assert outcome.error is None and len(outcome.results) == 8
    for result in outcome.results.values():
        assert_failed(result, code_pb2.UNAVAILABLE, "UPSTREAM_UNAVAILABLE", attempts="3")
        assert info(result).metadata["upstreamUrl"].endswith("/verify")
    assert outcome.seconds < 2 * 0.3 + MARGIN  # backoff: at most 0.1 s + 0.2 s per item
    assert_still_serves(stub, row)


@pytest.mark.parametrize("action", ["hang", "stall_body"])
def test_an_upstream_that_never_finishes_answering_times_out_each_item_once(
    stub, proxy, row, action
):
    """hang: accepts and reads the request, never answers. stall_body: sends the real reply's
    headers and half its body, then nothing. Timeouts are not retried."""
    proxy.set_faults(Fault(action))
    items = [item(f"{action}{i}", row, timeout_seconds=1.0) for i in range(8)]
    outcome = stream(stub, items)
    assert outcome.error is None and len(outcome.results) == 8
    for result in outcome.results.values():
        assert_failed(
            result,
            code_pb2.DEADLINE_EXCEEDED,
            "UPSTREAM_TIMEOUT",
            attempts="1",
            timeoutSeconds="1.000",
        )
    assert outcome.seconds < 1.0 + MARGIN
    assert all(proxy.attempts[i.request_id] == 1 for i in items)
    assert wait_until(lambda: proxy.in_flight == 0, 5), proxy.in_flight  # connections closed
    proxy.set_faults()
    assert_still_serves(stub, row)


# --- HTTP status codes ---------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 502, 503, 504, 429])
def test_a_transient_status_is_retried_and_the_item_scored(stub, proxy, row, status):
    items = [item(f"s{status}-{i}", row, answer=i % 2 == 0) for i in range(6)]
    proxy.set_faults(
        *(Fault("status", match=f'resp_{i.request_id}"', times=1, status=status) for i in items)
    )
    results = scored(stub, items)
    for i, request in enumerate(items):
        assert_rewarded(results[request.request_id], 1.0 if i % 2 == 0 else 0.0)
        assert proxy.attempts[request.request_id] == 2


@pytest.mark.parametrize(
    ("status", "code", "attempts"),
    [
        (502, code_pb2.UNAVAILABLE, 3),
        (503, code_pb2.UNAVAILABLE, 3),
        (504, code_pb2.UNAVAILABLE, 3),
        (429, code_pb2.RESOURCE_EXHAUSTED, 3),
        (500, code_pb2.INTERNAL, 3),
        (501, code_pb2.INTERNAL, 1),
        (422, code_pb2.INVALID_ARGUMENT, 1),
        (400, code_pb2.INVALID_ARGUMENT, 1),
        (401, code_pb2.UNAUTHENTICATED, 1),
        (403, code_pb2.PERMISSION_DENIED, 1),
        (404, code_pb2.UNIMPLEMENTED, 1),
    ],
)
def test_a_status_that_persists_maps_to_its_code_after_the_allowed_attempts(
    stub, proxy, row, status, code, attempts
):
    proxy.set_faults(Fault("status", status=status, body=b'"upstream says no"'))
    items = [item(f"p{status}-{i}", row) for i in range(4)]
    results = scored(stub, items)
    for request in items:
        result = results[request.request_id]
        assert_failed(
            result, code, "UPSTREAM_HTTP_ERROR", httpStatus=str(status), attempts=str(attempts)
        )
        assert "upstream says no" in result.error.message
        assert proxy.attempts[request.request_id] == attempts
    proxy.set_faults()
    assert_still_serves(stub, row)  # the upstream recovered; so does the bridge


# --- replies of 200 that carry no reward ---------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"<html>gateway error</html>",
        b'{"reward": ',
        b"",
        b"[1.0]",
        b'"1.0"',
        b'{"responses_create_params": {}, "extracted_answer": "B"}',
        b'{"reward": null}',
        b'{"reward": "1.0"}',
        b'{"reward": true}',
        b'{"reward": NaN}',
        b'{"reward": 1e999}',
        b'{"reward": 1.0, "reward_components": {"format": "ok"}}',
        b'{"reward": 1.0, "reward_components": {"\\ud800": 1.0}}',
        b"\xff\xfe{",
    ],
)
def test_a_200_reply_without_a_usable_reward_is_a_bad_reply_not_a_reward(stub, proxy, row, body):
    proxy.set_faults(Fault("reply", body=body))
    results = scored(stub, [item("bad-reply", row)])
    assert_failed(results["bad-reply"], code_pb2.INTERNAL, "UPSTREAM_BAD_REPLY", attempts="1")
    assert proxy.attempts["bad-reply"] == 1


@pytest.mark.parametrize(
    ("body", "code", "reason"),
    [
        (
            b'{"reward": 0.0, "_ng_failure_class": "judge_failed",'
            b' "_ng_failure_judge_error": "judge unreachable \\ud800"}',
            code_pb2.UNAVAILABLE,
            "UPSTREAM_JUDGE_FAILED",
        ),
        (
            b'{"reward": 0.0, "_ng_failure_class": "verifier_crashed"}',
            code_pb2.UNKNOWN,
            "UPSTREAM_MASKED_SAMPLE",
        ),
        (
            b'{"reward": 0.0, "failure_kind": "judge_timeout", "mask_sample": true}',
            code_pb2.UNKNOWN,
            "UPSTREAM_MASKED_SAMPLE",
        ),
        (b'{"reward": 0.0, "mask_sample": true}', code_pb2.UNKNOWN, "UPSTREAM_MASKED_SAMPLE"),
    ],
)
def test_failure_markers_in_a_200_reply_are_failures_not_zero_rewards(
    stub, proxy, row, body, code, reason
):
    proxy.set_faults(Fault("reply", body=body))
    results = scored(stub, [item("marked", row), item("marked-too", row)])
    for result in results.values():
        assert_failed(result, code, reason, attempts="1")
    assert proxy.attempts["marked"] == 1  # the bridge does not repeat judge calls


# --- connections that break ----------------------------------------------------------------


def test_connections_closed_mid_batch_retry_or_fail_only_their_items(stub, proxy, row):
    """drop: close without any response; cut: close after the headers and half the body.
    Once = the retry scores the item; always = UNAVAILABLE after 3 attempts."""
    kinds = {"drop-always": 3, "drop-once": 2, "cut-always": 3, "cut-once": 2}
    faults, items = [], []
    for kind in kinds:
        action = "drop" if kind.startswith("drop") else "cut_body"
        for i in range(4):
            request_id = f"{kind}-{i}"
            items.append(item(request_id, row))
            times = 1 if kind.endswith("once") else None
            faults.append(Fault(action, match=f'resp_{request_id}"', times=times))
    items += [item(f"fine-{i}", row) for i in range(16)]
    proxy.set_faults(*faults)
    results = scored(stub, items)
    for request in items:
        result = results[request.request_id]
        kind = request.request_id.rsplit("-", 1)[0]
        if kind.endswith("always"):
            assert_failed(result, code_pb2.UNAVAILABLE, "UPSTREAM_UNAVAILABLE", attempts="3")
        else:
            assert_rewarded(result)
        assert proxy.attempts[request.request_id] == kinds.get(kind, 1)
    assert wait_until(lambda: proxy.in_flight == 0, 5), proxy.in_flight


def test_an_upstream_restart_is_recovered_without_restarting_the_bridge(stub, proxy, row):
    """Idle keep-alive connections die with a restart; requests in flight are cut mid-way
    and retried on fresh connections once the upstream listens again."""
    assert_still_serves(stub, row, "before")  # the bridge holds keep-alive connections
    proxy.restart(downtime=0.5)
    idle = [item(f"idle-{i}", row) for i in range(64)]
    assert all(r.reward == 1.0 for r in scored(stub, idle).values())

    # first attempts are slow, so all 64 are in flight at the restart; retries are not
    proxy.set_faults(Fault("pass", seconds=3.0, times=64))
    busy = [item(f"busy-{i}", row) for i in range(64)]
    outcome: dict[str, Outcome] = {}
    thread = threading.Thread(target=lambda: outcome.update(o=stream(stub, busy)))
    thread.start()
    assert wait_until(lambda: proxy.in_flight == 64, 30), proxy.in_flight
    proxy.restart(downtime=0.0)
    thread.join(60)
    results = outcome["o"].results
    assert outcome["o"].error is None and len(results) == 64
    for request in busy:
        assert_rewarded(results[request.request_id])
        assert proxy.attempts[request.request_id] == 2  # cut once, retried once
    print(
        f"\nrestart with 64 requests in flight: all 64 retried once and scored in "
        f"{outcome['o'].seconds:.2f} s"
    )


# --- one slow item, cancellation, deadlines ------------------------------------------------


def test_one_hung_item_of_64_does_not_hold_back_the_other_63(stub, proxy, row):
    proxy.set_faults(Fault("hang", match='resp_hung"'))
    items = [item(f"quick-{i}", row) for i in range(63)]
    items.insert(17, item("hung", row, timeout_seconds=3.0))
    call = stub.VerifyStream(iter([verify_pb2.VerifyStreamRequest(items=items)]), timeout=60)
    in_flight_when_63_done = None
    seen: list[str] = []
    started = time.monotonic()
    for message in call:
        seen += [r.request_id for r in message.results]
        if len(seen) == 63 and in_flight_when_63_done is None:
            in_flight_when_63_done = proxy.in_flight
        results = {r.request_id: r for r in message.results}
        if "hung" in results:
            hung, hung_at = results["hung"], time.monotonic() - started
    assert sorted(seen) == sorted(i.request_id for i in items)
    assert seen[-1] == "hung"  # the 63 came back first, while the hung one was pending
    assert in_flight_when_63_done == 1
    assert_failed(hung, code_pb2.DEADLINE_EXCEEDED, "UPSTREAM_TIMEOUT", attempts="1")
    assert hung_at < 3.0 + MARGIN
    print(f"\none hung item of 64: 63 results first, the hung one failed after {hung_at:.2f} s")


def test_cancelling_a_1000_item_stream_halfway_ends_its_upstream_requests(stub, proxy, row):
    proxy.set_faults(Fault("pass", times=500), Fault("hang"))
    items = [item(f"c{i}", row) for i in range(1000)]
    batches = [verify_pb2.VerifyStreamRequest(items=items[k : k + 64]) for k in range(0, 1000, 64)]
    call = stub.VerifyStream(iter(batches), timeout=120)
    received = 0
    for message in call:
        received += len(message.results)
        if received >= 500:
            break
    assert wait_until(lambda: proxy.in_flight == 64, 10)  # hung requests take every slot
    in_flight_at_cancel = proxy.in_flight
    call.cancel()
    cancelled_at = time.monotonic()
    assert wait_until(lambda: proxy.in_flight == 0, 10), proxy.in_flight
    freed_after = time.monotonic() - cancelled_at
    # --max-in-flight 64: had the cancelled requests kept their slots, nothing would pass now.
    proxy.set_faults()
    assert_still_serves(stub, row, "after-cancel")
    print(
        f"\ncancel after {received} of 1000 results: {in_flight_at_cancel} upstream requests "
        f"in flight -> 0 in {freed_after:.3f} s"
    )


def test_the_client_deadline_ends_every_item_and_its_upstream_requests(stub, proxy, row):
    proxy.set_faults(Fault("hang"))
    items = [item(f"dl{i}", row) for i in range(16)]  # no per-item timeout: 30 s default
    outcome = stream(stub, items, timeout=2.0)
    for request in items:  # a per-item result just before the deadline, or the call's status
        result = outcome.results.get(request.request_id)
        if result is None:
            assert outcome.error is not None
            assert outcome.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            assert_failed(result, code_pb2.DEADLINE_EXCEEDED, "UPSTREAM_TIMEOUT")
    assert outcome.seconds < 2.0 + MARGIN
    assert wait_until(lambda: proxy.in_flight == 0, 10), proxy.in_flight
    try:
        single = stub.Verify(item("dl-unary", row), timeout=2.0)
        assert_failed(single, code_pb2.DEADLINE_EXCEEDED, "UPSTREAM_TIMEOUT")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: proxy.in_flight == 0, 10), proxy.in_flight
    print(
        f"\nclient deadline 2 s: {len(outcome.results)} of 16 items answered per item, "
        f"the rest by the call's {outcome.error and outcome.error.code()}"
    )
    proxy.set_faults()
    assert_still_serves(stub, row)


def test_sigterm_mid_stream_gives_every_item_one_outcome_within_the_grace(proxy, row):
    with start_bridge(
        "--server", f"mcqa={proxy.url}", "--grace", "2", "--health-interval", "600"
    ) as bridge:
        proxy.set_faults(Fault("pass", times=100), Fault("hang"))
        items = [item(f"t{i}", row) for i in range(200)]
        keep_open = threading.Event()

        def batches():
            for k in range(0, 200, 50):
                yield verify_pb2.VerifyStreamRequest(items=items[k : k + 50])
            keep_open.wait(60)  # the client has more to send when the bridge stops

        with grpc.insecure_channel(bridge.target) as channel:
            call = verify_pb2_grpc.VerifyServiceStub(channel).VerifyStream(batches(), 60)
            results: dict[str, verify_pb2.VerifyResponse] = {}
            signalled_at = None
            try:
                for message in call:
                    for result in message.results:
                        assert result.request_id not in results
                        results[result.request_id] = result
                    if len(results) >= 100 and signalled_at is None:
                        os.kill(bridge.pid, signal.SIGTERM)
                        signalled_at = time.monotonic()
                stream_error = None
            except grpc.RpcError as exc:
                stream_error = exc
            ended_after = time.monotonic() - signalled_at
            keep_open.set()
        assert bridge.proc.wait(30) == 0
    assert len(results) == 100 and all(r.reward == 1.0 for r in results.values())
    assert stream_error is not None and stream_error.code() == grpc.StatusCode.UNAVAILABLE
    assert ended_after < 2.0 + MARGIN
    assert wait_until(lambda: proxy.in_flight == 0, 10), proxy.in_flight
    print(
        f"\nSIGTERM with 100 of 200 items unanswered (--grace 2): 100 results, the rest "
        f"ended by UNAVAILABLE {stream_error.details()!r} after {ended_after:.2f} s, exit 0"
    )


# --- bad input -----------------------------------------------------------------------------


def test_64_items_of_100_kb_in_one_message_are_all_scored(stub, proxy, row):
    filler = "Let me think about every option in turn. " * 2500  # ~100 KB
    items = [item(f"big{i}", row, answer=i % 4 != 0) for i in range(64)]
    for request in items:
        request.completion = filler + request.completion
    message = verify_pb2.VerifyStreamRequest(items=items)
    assert message.ByteSize() > 6 * MiB  # over gRPC's default 4 MiB receive limit
    results = scored(stub, items)
    for i, request in enumerate(items):
        assert_rewarded(results[request.request_id], 0.0 if i % 4 == 0 else 1.0)


def test_lone_surrogate_escapes_fail_their_item_and_the_rest_is_scored(stub, proxy, row, nemo_gym):
    """A JSON text escape like "\\ud800" decodes to a lone surrogate, which is not Unicode
    text: the bridge refuses the item (a real NeMo Gym server answers such a body with 500).
    A valid surrogate pair ("\\ud83d\\ude00", an emoji) is fine."""
    lone = dict(row, note="\ud800")
    text = f"\\boxed{{{row['expected_answer']}}} \udfff"
    response = completion_response(text, "policy")
    items = [
        verify_pb2.VerifyRequest(
            request_id="lone-row", resources_server="mcqa", row_json=json.dumps(lone)
        ),
        item("lone-response", row, response_json=json.dumps(response)),
        item("lone-params", row, responses_create_params_json='{"input": "\\udbff x"}'),
        item("pair", row, completion=f"\U0001f600 \\boxed{{{row['expected_answer']}}}"),
        item("plain", row),
    ]
    assert "\\ud800" in items[0].row_json and "\\ud83d\\ude00" in json.dumps("\U0001f600")
    results = scored(stub, items)
    for request_id, field_name in [
        ("lone-row", "row_json"),
        ("lone-response", "response_json"),
        ("lone-params", "responses_create_params_json"),
    ]:
        assert_failed(
            results[request_id], code_pb2.INVALID_ARGUMENT, "INVALID_ITEM", field=field_name
        )
        assert proxy.attempts[request_id] == 0  # never sent upstream
    assert_rewarded(results["pair"])
    assert_rewarded(results["plain"])
    direct = requests.post(
        f"{nemo_gym.server_urls['mcqa']}/verify",
        data=json.dumps({**row, "response": response}),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert direct.status_code == 500  # why the bridge refuses these items itself


def test_invalid_utf8_on_the_wire_ends_the_stream_with_invalid_argument(bridge, stub, row):
    """Proto3 strings must be valid UTF-8; a message that is not cannot be parsed, so its
    items have no request_id to answer. The stream answers what it read before, then ends
    INVALID_ARGUMENT. (A unary Verify with such bytes: see test_message_limits.py.)"""
    good = verify_pb2.VerifyStreamRequest(items=[item("before", row)]).SerializeToString()
    marker = "REPLACEDBYINVALIDUTF8"
    broken = verify_pb2.VerifyStreamRequest(items=[item("broken", row, completion=marker)])
    bad = broken.SerializeToString().replace(marker.encode(), b"\xff\xfe" + b"x" * 19)
    after = verify_pb2.VerifyStreamRequest(items=[item("after", row)]).SerializeToString()
    sent = threading.Event()

    def messages():
        yield good
        sent.wait(30)  # "before" is answered first
        yield bad
        yield after

    with grpc.insecure_channel(bridge.target) as channel:
        method = channel.stream_stream(
            "/nemo_gym_grpc.v1.VerifyService/VerifyStream",
            request_serializer=lambda raw: raw,
            response_deserializer=verify_pb2.VerifyStreamResponse.FromString,
        )
        results, error = {}, None
        try:
            for message in method(messages(), timeout=30):
                results.update({r.request_id: r for r in message.results})
                sent.set()
        except grpc.RpcError as exc:
            error = exc
    assert list(results) == ["before"] and results["before"].reward == 1.0
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be parsed" in error.details() and "UTF-8" in error.details()
    assert_still_serves(stub, row)


def test_unknown_servers_and_malformed_items_fail_alone(stub, proxy, row):
    bad = {
        "unknown": (dict(resources_server="no_such_server"), code_pb2.NOT_FOUND),
        "no-server": (dict(resources_server=""), code_pb2.INVALID_ARGUMENT),
        "row-not-json": (dict(row_json="{"), code_pb2.INVALID_ARGUMENT),
        "row-a-list": (dict(row_json="[]"), code_pb2.INVALID_ARGUMENT),
        "row-nan": (dict(row_json='{"x": NaN}'), code_pb2.INVALID_ARGUMENT),
        "response-a-string": (dict(response_json='"text"'), code_pb2.INVALID_ARGUMENT),
        "deep": (dict(row_json="[" * 100_000 + "]" * 100_000), code_pb2.INVALID_ARGUMENT),
        "negative-timeout": (dict(timeout_seconds=-1.0), code_pb2.INVALID_ARGUMENT),
        "nan-timeout": (dict(timeout_seconds=float("nan")), code_pb2.INVALID_ARGUMENT),
        "inf-timeout": (dict(timeout_seconds=float("inf")), code_pb2.INVALID_ARGUMENT),
    }
    items = [item(request_id, row, **fields) for request_id, (fields, _) in bad.items()]
    items.append(item("good", row))
    results = scored(stub, items)
    for request_id, (_, code) in bad.items():
        assert results[request_id].error.code == code, results[request_id].error.message
        assert results[request_id].reward == 0.0
    assert_rewarded(results["good"])
    assert sum(proxy.attempts.values()) == 1


def test_an_item_over_the_size_limit_fails_alone(stub, proxy, row):
    huge = item("huge", row, completion="x" * (MAX_ITEM_BYTES + 1))
    results = scored(stub, [huge, item("small", row)])
    assert_failed(
        results["huge"],
        code_pb2.INVALID_ARGUMENT,
        "ITEM_TOO_LARGE",
        maxItemBytes=str(MAX_ITEM_BYTES),
        itemBytes=str(huge.ByteSize()),
    )
    assert_rewarded(results["small"])
    assert proxy.attempts["huge"] == 0


# --- memory under a long stream ------------------------------------------------------------


def _memory_mib(pid: int) -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (peak resident) of `pid`, MiB."""
    values = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0]) // 1024
    return values


@pytest.mark.nemo_gym  # starts a bridge process (tests.support.start_bridge) itself
def test_10000_items_against_a_slow_upstream_keep_the_bridge_memory_bounded(scripted):
    """50 ms per /verify, 64 at a time: the client could send far faster than the upstream
    answers. The bridge holds at most --max-stream-items; the rest waits in the client
    (gRPC flow control). Without the bound the bridge grew by ~230 MiB here."""
    held, total = 256, 10_000
    scripted.set_faults(Fault("status", body=b'{"reward": 1.0}', seconds=0.05))
    completion = "Let me think. " * 570  # ~8 KB per item
    with (
        start_bridge(
            "--server",
            f"slow={scripted.url}",
            "--max-stream-items",
            str(held),
            "--max-in-flight",
            "64",
            "--health-interval",
            "600",
        ) as bridge,
        grpc.insecure_channel(bridge.target) as channel,
    ):
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        warm = [
            verify_pb2.VerifyRequest(
                request_id=str(i), resources_server="slow", completion=completion
            )
            for i in range(64)
        ]
        scored(stub, warm)
        before = _memory_mib(bridge.pid)["VmRSS"]
        sent = 0
        lead = 0

        def batches():
            nonlocal sent
            for k in range(0, total, 64):
                chunk = [
                    verify_pb2.VerifyRequest(
                        request_id=str(i), resources_server="slow", completion=completion
                    )
                    for i in range(k, min(total, k + 64))
                ]
                sent += len(chunk)
                yield verify_pb2.VerifyStreamRequest(items=chunk)

        received, rewards = set(), 0.0
        for message in stub.VerifyStream(batches(), timeout=600):
            for result in message.results:
                assert not result.HasField("error") and result.request_id not in received
                received.add(result.request_id)
                rewards += result.reward
            lead = max(lead, sent - len(received))
        memory = _memory_mib(bridge.pid)
    grown = memory["VmHWM"] - before
    print(
        f"\n10,000 items x 8 KB, 50 ms upstream, --max-stream-items {held}: bridge RSS "
        f"{before} MiB before, peak {memory['VmHWM']} MiB (+{grown}), {memory['VmRSS']} MiB "
        f"after; most items sent but unanswered: {lead}; upstream peak in flight "
        f"{scripted.peak_in_flight}"
    )
    assert len(received) == total and rewards == total
    assert grown < 100
    # How far ahead of the results the client gets (`lead`, printed above) is gRPC's own
    # buffering, client and transport, which the bridge does not set: 831-5,694 items in
    # earlier runs, ~1,000 here, and once 9,823 in CI with the bridge still under its memory
    # bound. The bridge's bound is what is asserted: `grown` above.
    assert scripted.peak_in_flight <= 64


# --- retry budget and queueing (in-process Verifier, real HTTP) ----------------------------


async def test_the_retry_budget_bounds_attempts_and_time():
    policy = RetryPolicy(attempts=50, initial_backoff=0.05, max_backoff=0.2, budget=1.0)
    async with aiohttp.ClientSession() as session:
        upstreams = Upstreams({"down": f"http://127.0.0.1:{closed_port()}"}, None, session)
        verifier = verifier_for(upstreams, session, retry=policy)
        started = time.monotonic()
        result = await verifier.verify(
            verify_pb2.VerifyRequest(request_id="x", resources_server="down"), None
        )
    attempts = int(info(result).metadata["attempts"])
    assert info(result).reason == "UPSTREAM_UNAVAILABLE" and 2 <= attempts < 50
    assert time.monotonic() - started < 1.0 + MARGIN


async def test_waiting_for_an_upstream_slot_does_not_eat_the_item_timeout(proxy, row):
    """--max-in-flight 1 and a 0.5 s upstream: the third item waits ~1 s for its slot yet
    still gets its own 0.8 s. Under an RPC deadline, the wait is reported."""
    proxy.set_faults(Fault("pass", seconds=0.5))
    async with aiohttp.ClientSession() as session:
        upstreams = Upstreams({"mcqa": proxy.url}, None, session)
        verifier = verifier_for(upstreams, session, max_in_flight=1)
        items = [item(f"q{i}", row, timeout_seconds=0.8) for i in range(3)]
        results = await _gather(verifier, items, None)
        assert all(not r.HasField("error") and r.reward == 1.0 for r in results)
        assert proxy.peak_in_flight == 1

        deadline = time.monotonic() + 1.3
        results = await _gather(verifier, [item(f"d{i}", row) for i in range(3)], deadline)
    assert results[0].reward == 1.0 and results[2].error.code == code_pb2.DEADLINE_EXCEEDED
    late = info(results[2])
    assert late.reason == "UPSTREAM_TIMEOUT" and float(late.metadata["queuedSeconds"]) >= 0.5


async def _gather(verifier, items, deadline):
    return await asyncio.gather(*(verifier.verify(i, deadline) for i in items))


async def test_a_retry_never_overlaps_the_attempt_before_it(proxy, row):
    proxy.set_faults(Fault("status", status=503, seconds=0.2))
    async with aiohttp.ClientSession() as session:
        verifier = verifier_for(Upstreams({"mcqa": proxy.url}, None, session), session)
        result = await verifier.verify(item("one", row), None)
    assert info(result).metadata["attempts"] == "3" and proxy.attempts["one"] == 3
    assert proxy.peak_in_flight == 1


async def test_max_item_bytes_is_a_verifier_argument(row):
    async with aiohttp.ClientSession() as session:
        verifier = verifier_for(Upstreams({}, None, session), session, max_item_bytes=1000)
        result = await verifier.verify(item("big", row, completion="x" * 1000), None)
    assert_failed(result, code_pb2.INVALID_ARGUMENT, "ITEM_TOO_LARGE", maxItemBytes="1000")
