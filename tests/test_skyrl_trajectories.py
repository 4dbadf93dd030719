"""NeMo Gym rollouts as SkyRL trajectories (rewards/skyrl/trajectories.py); no servers, no
skyrl (the generator around it runs in skyrl's own venv: tests/test_skyrl_generator.py)."""

from __future__ import annotations

import pytest

from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.rewards.skyrl.trajectories import FAILED, GROUP_FAILED, trajectories
from nemo_gym_grpc.v1 import rollout_pb2

EOS = 2
MASKED = Failure("UNKNOWN", "UPSTREAM_MASKED_SAMPLE", "masked", metadata={"failureKind": "x"})


def rollout(reward: float, gap: bool = False) -> rollout_pb2.RunResponse:
    """Two turns: [1, 4, 9] -> [20, 21], then [1, 4, 9, 20, 21, 6, 7] -> [22, 2] (`gap`: the
    second prompt does not continue the first)."""
    second = [1, 4, 8] if gap else [1, 4, 9, 20, 21, 6, 7]
    turns = [
        rollout_pb2.Turn(prompt_token_ids=[1, 4, 9], generation_token_ids=[20, 21],
                         generation_log_probs=[-1, -2]),
        rollout_pb2.Turn(prompt_token_ids=second, generation_token_ids=[22, 2],
                         generation_log_probs=[-0.5, -0.25]),
    ]  # fmt: skip
    return rollout_pb2.RunResponse(rollout=rollout_pb2.Rollout(reward=reward, turns=turns))


def test_a_rollout_is_one_sequence_that_trains_on_what_the_policy_generated():
    out = trajectories([rollout(1.0), rollout(0.0)], ["a", "a"], EOS)
    assert out["prompt_token_ids"] == [[1, 4, 9]] * 2
    assert out["response_ids"][0] == [20, 21, 6, 7, 22, 2]
    assert out["loss_masks"][0] == [1, 1, 0, 0, 1, 1]
    assert out["rollout_logprobs"][0] == [-1.0, -2.0, 0.0, 0.0, -0.5, -0.25]
    assert out["rewards"] == [1.0, 0.0]
    assert out["stop_reasons"] == ["stop", "stop"] and out["errors"] == [None, None]


def test_a_failed_masked_or_unstitchable_rollout_masks_its_whole_group_only():
    outcomes = [rollout(1.0), MASKED, rollout(0.0), rollout(1.0, gap=True), rollout(1.0)]
    out = trajectories(outcomes, ["a", "a", "b", "b", "c"], EOS)
    assert out["loss_masks"] == [[0], [0], [0], [0], [1, 1, 0, 0, 1, 1]]
    assert out["response_ids"][:4] == [[EOS]] * 4
    assert out["rewards"] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert out["stop_reasons"] == [GROUP_FAILED, FAILED, GROUP_FAILED, FAILED, "stop"]
    assert out["prompt_token_ids"][1] == [EOS]  # no tokens of its own
    assert "UPSTREAM_MASKED_SAMPLE" in out["errors"][1]
    assert "TURNS_NOT_CONTIGUOUS" in out["errors"][3]
    assert out["errors"][0] is None and out["errors"][4] is None


def test_groups_must_match_the_rollouts():
    with pytest.raises(ValueError, match="1 groups for 2 rollouts"):
        trajectories([rollout(1.0), rollout(1.0)], ["a"], EOS)
