"""What the reward functions make of outcomes (no I/O: outcomes made by hand): the failure
policy, and the extras for TRL's log_metric / log_extra.
"""

from __future__ import annotations

import json

import pytest

from nemo_gym_grpc.rewards import ScoringError, create_nemo_gym_reward_fn, reward_nemo_gym_verify
from nemo_gym_grpc.rewards.client import outcomes, policy, settings
from nemo_gym_grpc.rewards.trl import logs
from nemo_gym_grpc.v1 import verify_pb2
from tests.support import closed_port

# --------------------------------------------------------------------------------------------
# the failure policy (no I/O: outcomes made by hand)


def _outcomes(*rewards):
    """A VerifyResponse per float, a Failure per cause string ("CODE" or "CODE/REASON")."""
    made = []
    for value in rewards:
        if isinstance(value, str):
            code, _, reason = value.partition("/")
            made.append(outcomes.Failure(code, reason or None, f"{value} happened"))
        else:
            made.append(verify_pb2.VerifyResponse(reward=value))
    return made


def _apply(outcomes, on_error="none", fraction=0.5):
    return policy.apply(outcomes, on_error=on_error, max_failure_fraction=fraction, where="here")


def test_policy_none_gives_none_and_zero_gives_zero_for_failed_items():
    outcomes = _outcomes(1.0, "UNAVAILABLE/UPSTREAM_UNAVAILABLE", 0.0, 0.5)
    assert _apply(outcomes) == [1.0, None, 0.0, 0.5]
    assert _apply(outcomes, "zero") == [1.0, 0.0, 0.0, 0.5]
    assert _apply(_outcomes(2.0, -1.0)) == [2.0, -1.0]  # rewards are not clamped


def test_policy_raise_raises_for_one_failure_with_its_cause():
    with pytest.raises(ScoringError) as raised:
        _apply(_outcomes(1.0, 1.0, 1.0, "NOT_FOUND/UNKNOWN_RESOURCES_SERVER"), "raise")
    error = raised.value
    assert list(error.failures) == [3] and error.size == 4
    assert error.causes == {"NOT_FOUND (UNKNOWN_RESOURCES_SERVER)": 1}
    assert "1 of 4 items failed (on_error=raise; here)" in str(error)
    assert "NOT_FOUND/UNKNOWN_RESOURCES_SERVER happened" in str(error)


@pytest.mark.parametrize("on_error", ["none", "zero"])
def test_the_guard_raises_above_the_fraction_whatever_the_policy(on_error):
    outcomes = _outcomes(1.0, "UNAVAILABLE", "UNAVAILABLE", "DEADLINE_EXCEEDED")
    with pytest.raises(ScoringError) as raised:
        _apply(outcomes, on_error)
    assert "3 of 4 items failed, more than max_failure_fraction=0.5 allows" in str(raised.value)
    assert "UNAVAILABLE x2, DEADLINE_EXCEEDED x1" in str(raised.value)
    assert sorted(raised.value.failures) == [1, 2, 3]
    # exactly at the fraction is allowed; 1 turns the guard off; 0 raises for any failure
    assert _apply(outcomes[:2] + _outcomes(0.0, "UNAVAILABLE"), on_error)[0] == 1.0
    assert len(_apply(outcomes, on_error, fraction=1.0)) == 4
    with pytest.raises(ScoringError):
        _apply(_outcomes(1.0, 1.0, 1.0, "UNAVAILABLE"), on_error, fraction=0.0)


def test_failed_items_log_one_warning_by_cause(caplog):
    outcomes = _outcomes(1.0, "UNAVAILABLE/X", 1.0, "UNAVAILABLE/X", "INTERNAL/Y", 1.0)
    with caplog.at_level("WARNING", logger="nemo_gym_grpc.rewards"):
        assert _apply(outcomes, "zero", fraction=0.5) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    (record,) = caplog.records
    assert record.getMessage().startswith("3 of 6 items failed (reward 0.0, on_error=zero; here)")
    assert "UNAVAILABLE (X) x2, INTERNAL (Y) x1" in record.getMessage()


def test_all_items_rejected_locally_raise_without_contacting_a_bridge(monkeypatch):
    monkeypatch.setenv(settings.TARGET_ENV, f"127.0.0.1:{closed_port()}")
    monkeypatch.setenv(settings.CONNECT_TIMEOUT_ENV, "0.1")
    args = {"completions": ["\ud800", "\udfff"], "resources_server_ref": [{"name": "x"}] * 2}
    with pytest.raises(ScoringError, match=r"INVALID_ARGUMENT \(INVALID_ITEM\) x2"):
        reward_nemo_gym_verify(**args)
    reward_fn = create_nemo_gym_reward_fn({}, {}, max_failure_fraction=1.0)
    metrics = []
    assert reward_fn(**args, log_metric=lambda *m: metrics.append(m)) == [None, None]
    assert metrics == [
        ("rewards/nemo_gym/failed_fraction", 1.0),
        ("rewards/nemo_gym/degraded_fraction", 0.0),
    ]


# --------------------------------------------------------------------------------------------
# extras for TRL's log_metric / log_extra (no I/O)


def test_item_values_are_components_and_the_servers_own_numeric_reply_fields():
    reply = {
        "equivalence_score": 0.75,
        "score": 2,
        "difficulty": 3,  # echoed from the row: an input, not a result
        "mask_sample": False,  # bools are not metrics
        "extracted_answer": "B",
        "_ng_task_index": 4,
        "nan": float("nan"),
    }
    outcome = verify_pb2.VerifyResponse(
        reward=1.0, reward_components={"format": 1.0}, reply_json=json.dumps(reply)
    )
    assert logs.item_values(outcome, {"difficulty": 3, "question": "?"}) == {
        "components/format": 1.0,
        "reply/equivalence_score": 0.75,
        "reply/score": 2.0,
    }
    assert logs.item_values(outcomes.Failure("INTERNAL", None, "x"), None) == {}
    assert logs.item_values(verify_pb2.VerifyResponse(reply_json="[1]"), None) == {}


def test_extras_log_metrics_and_keeps_columns_aligned_across_calls():
    log = logs.ExtrasLog("fn")
    metrics, columns = [], []
    kwargs = {
        "log_metric": lambda name, value: metrics.append((name, value)),
        "log_extra": lambda column, values: columns.append((column, values)),
    }
    first = [
        verify_pb2.VerifyResponse(reward=1.0, reward_components={"a": 1.0}, latency_seconds=0.5),
        verify_pb2.VerifyResponse(reward=0.0, reward_components={"a": 0.0}, latency_seconds=1.5),
        outcomes.Failure("UNAVAILABLE", "UPSTREAM_UNAVAILABLE", "down"),
        verify_pb2.VerifyResponse(reward=0.0, latency_seconds=1.0),
        outcomes.Failure(
            "UNAVAILABLE",
            "UPSTREAM_JUDGE_FAILED",
            "judge",
            metadata={
                "failureKind": "judge_failed",
                "failureReason": "x" * 1000,
                "failureReport": '{"chain": []}',
            },
        ),
    ]
    log.emit(first, kwargs)
    assert metrics == [
        ("rewards/fn/failed_fraction", 0.4),
        ("rewards/fn/degraded_fraction", 0.0),
        ("rewards/fn/latency_seconds", 1.0),
        ("rewards/fn/components/a", 0.5),
    ]
    judge = "UNAVAILABLE (UPSTREAM_JUDGE_FAILED)"
    cut = "x" * (logs.MAX_LOGGED_TEXT - 3) + "..."  # a failed item's reason, bounded
    assert columns == [
        ("fn/error", [None, None, "UNAVAILABLE (UPSTREAM_UNAVAILABLE)", None, judge]),
        ("fn/failure_kind", [*[None] * 4, "judge_failed"]),
        ("fn/failure_reason", [*[None] * 4, cut]),
        ("fn/failure_report", [*[None] * 4, '{"chain": []}']),
        ("fn/components/a", [1.0, 0.0, None, None, None]),
    ]
    metrics.clear()
    columns.clear()
    log.emit([verify_pb2.VerifyResponse(reward=1.0, reward_components={"b": 2.0})], kwargs)
    assert ("rewards/fn/components/b", 2.0) in metrics
    assert columns == [
        ("fn/error", [None]),
        ("fn/failure_kind", [None]),
        ("fn/failure_reason", [None]),
        ("fn/failure_report", [None]),
        ("fn/components/a", [None]),
        ("fn/components/b", [2.0]),
    ]
    assert not logs.wanted({"log_metric": None}) and logs.wanted({"log_extra": print})
