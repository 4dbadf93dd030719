"""The fault matrix: every item sent gets exactly one outcome, a failure is never a reward,
nothing hangs past its bound, and the bridge keeps serving after each fault. Its real parts
and shared fixtures: tests/support/fault_matrix.py.

Here: an upstream that cannot be reached or does not answer, HTTP status codes, replies of 200
that carry no reward, connections that break. Also: test_faults_deadlines.py (one slow item,
cancellation, deadlines, SIGTERM), test_faults_input.py (bad input), test_faults_limits.py
(memory under a long stream, the retry budget and queueing).
"""

from __future__ import annotations

import threading

import pytest
from google.rpc import code_pb2

from tests.support import fault_matrix
from tests.support.fault_matrix import (
    MARGIN,
    assert_failed,
    assert_rewarded,
    assert_still_serves,
    wait_until,
)
from tests.support.fault_proxy import Fault
from tests.support.items import Outcome, scored, stream
from tests.support.items import error_info as info
from tests.support.items import mcqa_item as item

# The fault matrix's fixtures (tests/support/fault_matrix.py), this module's own.
row = fault_matrix.row
proxy = fault_matrix.proxy
scripted = fault_matrix.scripted
bridge = fault_matrix.bridge
no_faults = fault_matrix.no_faults


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
    """Idle keep-alive connections die with a restart; requests in flight that a server
    crash cuts mid-way (its listener back at once: `cut_connections`) are retried once on fresh
    connections. (A restart with downtime cut them too, but then a retry may land while the
    port refuses and fail all its attempts: those are counted by the retry tests.)"""
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
    proxy.cut_connections()
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
