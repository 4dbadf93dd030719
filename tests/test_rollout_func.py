"""The rollout client's pure parts: rows -> RunRequests (`rollouts.build_requests`), prompts ->
dataset rows (`RowIndex`), outcomes -> TRL's rollout_func output (NaN and masked
for failures), the failure guard; a call to a bridge that is not there (real gRPC), and an
embedded bridge whose head server is not there (a real bridge process)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time

import pytest

from nemo_gym_grpc.rewards import (
    ScoringError,
    arun_rollouts,
    create_nemo_gym_rollout_func,
    reward_env,
    run_rollouts,
)
from nemo_gym_grpc.rewards.client import embedded, policy, rollouts, settings, stream
from nemo_gym_grpc.rewards.client.outcomes import NO_TOKENS, Failure
from nemo_gym_grpc.rewards.trl.rollout_func import rollout_output
from nemo_gym_grpc.rewards.trl.rows import RowIndex, nemo_gym_row
from nemo_gym_grpc.shared.reasons import INVALID_ITEM
from nemo_gym_grpc.v1 import rollout_pb2, verify_pb2

PARAMS = {"input": [{"role": "user", "content": "What is 2 + 3?"}]}


def _row(**extra):
    return {"responses_create_params": PARAMS, "expected": 5, **extra}


# --------------------------------------------------------------------------------------------
# rows -> RunRequests


def test_each_row_goes_to_its_agent_ref_else_to_the_given_agent():
    rows = [_row(agent_ref={"type": "responses_api_agents", "name": "math_agent"}), _row()]
    batch = rollouts.build_requests(rows, agent="fallback", batch_id="b", run_timeout=30.0)
    assert [r.agent for r in batch.requests] == ["math_agent", "fallback"]
    assert [r.request_id for r in batch.requests] == ["b-0", "b-1"]
    assert json.loads(batch.requests[1].row_json) == rows[1]
    assert batch.requests[0].timeout_seconds == 30.0
    assert not batch.requests[0].responses_create_params_json  # the bridge takes the row's
    assert not batch.rejected


def test_a_row_without_an_agent_fails_alone_and_is_not_sent():
    batch = rollouts.build_requests(
        [_row(), _row(agent_ref={"name": "a"})], agent=None, batch_id="b"
    )
    assert [r.request_id for r in batch.requests] == ["b-1"]
    failure = batch.rejected[0]
    assert (failure.code, failure.reason) == ("INVALID_ARGUMENT", INVALID_ITEM)
    (outcome, sent) = batch.outcomes({"b-1": rollout_pb2.RunResponse(request_id="b-1")})
    assert outcome is failure and isinstance(sent, rollout_pb2.RunResponse)


def test_overrides_are_merged_into_the_rows_params_or_into_params_built_from_the_prompt():
    rows = [_row(), {"agent_ref": {"name": "a"}}]
    prompts = ["ignored: the row has its own params", [{"role": "user", "content": "hi"}]]
    batch = rollouts.build_requests(
        rows,
        agent="a",
        batch_id="b",
        prompts=prompts,
        responses_create_params={"temperature": 0.5},
    )
    first, second = (json.loads(r.responses_create_params_json) for r in batch.requests)
    assert first == {**PARAMS, "temperature": 0.5}
    assert second == {"input": [{"role": "user", "content": "hi"}], "temperature": 0.5}
    assert [(m.role, m.content) for m in batch.requests[1].prompt] == [("user", "hi")]


def test_text_that_is_not_unicode_fails_its_row_alone():
    rows = [_row(), _row()]
    batch = rollouts.build_requests(rows, agent="a", batch_id="b", prompts=["ok", "bad \ud800"])
    assert [r.request_id for r in batch.requests] == ["b-0"]
    assert "lone surrogate" in batch.rejected[1].message


def test_rows_and_prompts_of_other_lengths_are_refused():
    with pytest.raises(ValueError, match="prompts has 1 entries for 2 rows"):
        rollouts.build_requests([_row(), _row()], agent="a", batch_id="b", prompts=["x"])
    with pytest.raises(TypeError, match="row 0 must be a dict"):
        rollouts.build_requests(["not a row"], agent="a", batch_id="b")  # type: ignore[list-item]


# --------------------------------------------------------------------------------------------
# prompts -> dataset rows


def test_a_prompt_finds_its_dataset_row_however_its_dicts_are_ordered():
    prompt = [{"role": "user", "content": "q0"}]
    index = RowIndex(
        [{"prompt": prompt, "verify_extra": _row()}, {"prompt": "q1", "verify_extra": None}]
    )
    assert index.row([{"content": "q0", "role": "user"}])["verify_extra"] == _row()
    assert nemo_gym_row(index.row(prompt), "verify_extra") == _row()
    # without the column: the dataset row without its prompt
    assert nemo_gym_row(index.row("q1"), "verify_extra") == {"verify_extra": None}
    with pytest.raises(KeyError, match="no dataset row has the prompt 'q2'"):
        index.row("q2")
    # JSON text in the column (no Arrow None-filling)
    as_text = {"prompt": "q", "verify_extra": json.dumps(_row())}
    assert nemo_gym_row(as_text, "verify_extra") == _row()
    with pytest.raises(ValueError, match="the .verify_extra. column: a JSON list, not an object"):
        nemo_gym_row({"prompt": "q", "verify_extra": "[1]"}, "verify_extra")


def test_equal_rows_may_share_a_prompt_but_different_rows_may_not():
    same = {"prompt": "q", "expected": 1}
    assert len(RowIndex([same, dict(same)])) == 1
    index = RowIndex([same, {"prompt": "q", "expected": 2}])
    with pytest.raises(ValueError, match="2 different dataset rows have the prompt"):
        index.row("q")
    with pytest.raises(ValueError, match="row 0 has no `prompt`"):
        RowIndex([{"question": "q"}])


# --------------------------------------------------------------------------------------------
# outcomes -> rollout_func output


def _rollout(reward: float, turns: list[rollout_pb2.Turn]) -> rollout_pb2.RunResponse:
    return rollout_pb2.RunResponse(rollout=rollout_pb2.Rollout(reward=reward, turns=turns))


TWO_TURNS = [
    rollout_pb2.Turn(prompt_token_ids=[4, 5], generation_token_ids=[6], generation_log_probs=[-1]),
    rollout_pb2.Turn(
        prompt_token_ids=[4, 5, 6, 7], generation_token_ids=[8, 3], generation_log_probs=[-2, -3]
    ),
]


def test_rollouts_become_stitched_samples_and_failures_masked_eos_with_nan_reward():
    outcomes = [
        _rollout(1.0, TWO_TURNS),
        Failure("UNAVAILABLE", "AGENT_UNAVAILABLE", "agent down"),
        _rollout(0.0, []),  # a reward but no tokens (e.g. openai_model): not trainable
        _rollout(0.0, TWO_TURNS[:1]),
    ]
    output = rollout_output(outcomes, eos=3)
    assert output["prompt_ids"] == [[4, 5], [3], [3], [4, 5]]
    assert output["completion_ids"] == [[6, 7, 8, 3], [3], [3], [6]]
    assert output["env_mask"] == [[1, 0, 1, 1], [0], [0], [1]]
    assert output["logprobs"] == [[-1.0, 0.0, -2.0, -3.0], [0.0], [0.0], [-1.0]]
    assert output["num_turns"] == [2, 0, 0, 1]
    rewards = output["env_reward"]
    assert rewards[0] == 1.0 and rewards[3] == 0.0  # a real 0.0 stays 0.0
    assert math.isnan(rewards[1]) and math.isnan(rewards[2])  # failures: NaN, never 0.0
    assert output["rollout_error"] == [
        None,
        "UNAVAILABLE (AGENT_UNAVAILABLE)",
        f"INTERNAL ({NO_TOKENS})",
        None,
    ]
    # reward_env, fed by TRL with these values, passes them through
    passed = reward_env(["c"] * 4, env_reward=rewards)
    assert passed[0] == 1.0 and passed[3] == 0.0
    assert all(math.isnan(r) for r in (passed[1], passed[2]))  # type: ignore[arg-type]


def test_more_failures_than_allowed_raise_instead_of_training_on_an_outage(caplog):
    failures: dict[int, Failure] = {}
    outcomes = [_rollout(1.0, TWO_TURNS), Failure("UNAVAILABLE", None, "agent gone")]
    rollout_output(outcomes, eos=3, failures=failures)
    assert failures == {1: outcomes[1]}
    labels = {"where": "test", "what": "rollouts", "gives": "reward NaN"}
    policy.guard(failures, 2, max_failure_fraction=0.5, **labels)  # 1 of 2: allowed, and logged
    assert "1 of 2 rollouts failed" in caplog.text and "agent gone" in caplog.text
    with pytest.raises(ScoringError, match="1 of 2 rollouts failed, more than"):
        policy.guard(failures, 2, max_failure_fraction=0.4, **labels)


# --------------------------------------------------------------------------------------------
# no bridge: real gRPC to a port nobody listens on


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_bridge_that_is_not_there_fails_every_rollout_as_it_fails_every_score(
    monkeypatch, asynchronous
):
    """Rollouts wait for a connection as scoring does (NEMO_GYM_GRPC_CONNECT_TIMEOUT, within
    the call's deadline) and fail with the same code and message as `verify_batch`."""
    monkeypatch.setenv(settings.CONNECT_TIMEOUT_ENV, "0.2")
    target = f"127.0.0.1:{_closed_port()}"
    rows = [_row(), _row(), {}]
    began = time.monotonic()
    if asynchronous:
        outcomes = asyncio.run(arun_rollouts(rows, agent="a", target=target, batch_timeout=5))
    else:
        outcomes = run_rollouts(rows, agent="a", target=target, batch_timeout=5)
    waited = time.monotonic() - began
    call = stream.Call(
        stream.VERIFY,
        target,
        [verify_pb2.VerifyRequest(request_id="v", resources_server="mcqa")],
        timeout=600,  # the reward functions' default batch deadline
        connect_timeout=settings.connect_timeout(),
    )
    scored = stream.send(call)["v"]
    assert isinstance(scored, Failure)
    assert scored.message == f"no connection to the bridge at {target} within 0.2 s"
    for outcome in outcomes:
        assert isinstance(outcome, Failure) and outcome.whole_call
        assert (outcome.code, outcome.message) == ("UNAVAILABLE", scored.message)
    print(f"no bridge: {len(outcomes)} rollouts failed after {waited:.2f} s")


def test_the_rollout_func_refuses_a_failed_batch(monkeypatch):
    monkeypatch.setenv("NEMO_GYM_GRPC_CONNECT_TIMEOUT", "0.5")

    class Trainer:  # what the rollout_func reads of a GRPOTrainer, for a call that fails
        temperature, top_p = 1.0, 1.0
        train_dataset = [{"prompt": "q", "verify_extra": _row()}]
        eval_dataset = None

        class processing_class:  # noqa: N801
            eos_token_id = 3

    rollout_func = create_nemo_gym_rollout_func("a", target=f"127.0.0.1:{_closed_port()}")
    with pytest.raises(ScoringError, match=r"2 of 2 rollouts failed.*UNAVAILABLE x2"):
        rollout_func(["q", "q"], Trainer())
    with pytest.raises(KeyError, match="no dataset row has the prompt"):
        rollout_func(["other"], Trainer())


def test_with_the_head_server_down_every_rollout_fails_head_server_unavailable(monkeypatch):
    """No target: the embedded bridge starts over NEMO_GYM_HEAD_URL even when nothing answers
    there (a real bridge process), and each rollout fails UNAVAILABLE, not NOT_FOUND."""
    head_url = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.delenv(settings.TARGET_ENV, raising=False)
    monkeypatch.setenv(settings.HEAD_URL_ENV, head_url)
    try:
        outcomes = run_rollouts([_row(), _row()], agent="simple_agent", batch_timeout=30)
    finally:
        embedded.stop_all()
    for outcome in outcomes:
        assert isinstance(outcome, Failure) and not outcome.whole_call
        assert (outcome.code, outcome.reason) == ("UNAVAILABLE", "HEAD_SERVER_UNAVAILABLE")
        assert f"the head server {head_url} could not be read" in outcome.message
        assert outcome.metadata["headUrl"] == head_url
        assert outcome.metadata["agent"] == "simple_agent"
        assert "Connect" in outcome.metadata["discoveryError"]


def test_a_rollouts_nemo_gym_failure_kind_reaches_trls_completions_table():
    judged = Failure(
        "UNAVAILABLE",
        "UPSTREAM_JUDGE_FAILED",
        "judge down",
        metadata={"failureKind": "judge_failed", "failureReason": "503 " + "x" * 600},
    )
    output = rollout_output([_rollout(1.0, TWO_TURNS), judged], eos=3)
    text = output["rollout_error"][1]
    assert text.startswith("UNAVAILABLE (UPSTREAM_JUDGE_FAILED) failureKind=judge_failed")
    assert "failureReason=503 x" in text and len(text) == 500 and text.endswith("...")
    logged: dict[str, list] = {}
    reward_env(
        ["a", "b"],
        env_reward=output["env_reward"],
        rollout_error=output["rollout_error"],
        log_extra=lambda column, values: logged.setdefault(column, values),
    )
    assert logged == {"reward_env/rollout_error": [None, text]}
