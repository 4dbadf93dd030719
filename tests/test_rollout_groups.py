"""A finished group of rollouts -> TRL AsyncGRPOTrainer samples (rewards/trl/groups.py): the
advantages are those TRL 1.16's own rollout worker computes (its `_score_group` is run on the
same rewards, failures as its NaN rewards), failed and stale rollouts are left out of the group
(never a 0.0), a group with too few usable rollouts is dropped, and the samples carry the
stitched tokens, masks and logprobs."""

from __future__ import annotations

import asyncio
import json
import math
import types

import pytest

pytest.importorskip("numpy")  # groups' samples are numpy arrays (TRL installs it)

from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.rewards.trl import groups
from nemo_gym_grpc.v1 import rollout_pb2

PROMPT = [{"role": "user", "content": "weather in sf?"}]
OUTPUT = [
    {"type": "function_call", "name": "get_weather", "arguments": '{"city": "sf"}'},
    {"type": "function_call_output", "call_id": "c0", "output": "cold"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Cold."}]},
]
MASKED = Failure("UNKNOWN", "UPSTREAM_REPORTED_FAILURE", "masked", metadata={"failureKind": "x"})


def rollout(reward: float, components: dict[str, float] | None = None) -> rollout_pb2.RunResponse:
    """A two-turn rollout: [1, 4, 9] -> [20, 21], then [1, 4, 9, 20, 21, 6, 7] -> [22, 2]."""
    turns = [
        rollout_pb2.Turn(
            prompt_token_ids=[1, 4, 9], generation_token_ids=[20, 21], generation_log_probs=[-1, -2]
        ),
        rollout_pb2.Turn(
            prompt_token_ids=[1, 4, 9, 20, 21, 6, 7],
            generation_token_ids=[22, 2],
            generation_log_probs=[-0.5, -0.25],
        ),
    ]
    return rollout_pb2.RunResponse(
        request_id="r",
        rollout=rollout_pb2.Rollout(
            reward=reward,
            reward_components=components or {},
            output_json=json.dumps(OUTPUT),
            turns=turns,
        ),
        latency_seconds=0.1,
    )


def group_of(*outcomes, versions=None) -> groups.Group:
    group = groups.Group(group_id=7, prompt=PROMPT, size=len(outcomes))
    for index, outcome in enumerate(outcomes):
        version = versions[index] if versions else 3
        group.results.append(groups.Result(index, version, outcome))
    return group


def trl_advantages(rewards: list[float | None]) -> list[float]:
    """What TRL 1.16's own `_AsyncRolloutLoop._score_group` gives these per-rollout rewards
    (None = a rollout it could not score), run on a minimal loop object."""
    from accelerate.state import PartialState
    from trl.experimental.async_grpo.async_rollout_worker import (
        RolloutGroup,
        TrainingSequence,
        _AsyncRolloutLoop,
    )

    PartialState()  # accelerate's logger, which _score_group logs to, needs it
    size = len(rewards)
    loop = types.SimpleNamespace(
        reward_funcs=[],
        reward_func_names=["env"],
        _env_reward_types=[],
        _provides_rollout_reward=True,
    )
    group = RolloutGroup(
        prompts=[PROMPT] * size,
        reward_kwargs={},
        completions=[[]] * size,
        completions_ids=[[2]] * size,
        completions_sequences=[[TrainingSequence([1, 2], [0, 1], [0.0, -1.0], "r")]] * size,
        tool_call_counts=[0] * size,
        tool_failure_counts=[0] * size,
        model_version=0,
        group_id=0,
        env_rewards=[],
        rollout_rewards=list(rewards),
    )
    samples = asyncio.run(_AsyncRolloutLoop._score_group(loop, group))
    return [s.advantage for s in samples]


@pytest.mark.parametrize(
    "rewards",
    [
        [1.0, 0.0, 0.5, 1.0],
        [2.0, 2.0, 2.0],
        [0.3, None, 0.9, None, -1.5],
        [1e6, 1e6 + 1, 3.0],
    ],
)
def test_advantages_are_trls_own(rewards):
    outcomes = [MASKED if r is None else rollout(r) for r in rewards]
    verdict = groups.close(group_of(*outcomes), version=3, max_staleness=0, min_group_size=1)
    expected = [a for a, r in zip(trl_advantages(rewards), rewards, strict=True) if r is not None]
    assert [s.advantage for s in verdict.samples] == expected
    assert verdict.rewards == [r for r in rewards if r is not None]
    assert sorted(verdict.failures) == [i for i, r in enumerate(rewards) if r is None]


def test_a_sample_holds_the_stitched_tokens_and_the_metrics():
    import numpy as np

    verdict = groups.close(
        group_of(rollout(1.0, {"format": 1.0}), rollout(0.0), versions=[2, 3]),
        version=3,
        max_staleness=4,
        min_group_size=2,
    )
    first, second = verdict.samples
    assert first.input_ids.tolist() == [1, 4, 9, 20, 21, 6, 7, 22, 2]
    assert first.completion_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert first.old_log_probs.tolist() == [0, 0, 0, -1, -2, 0, 0, -0.5, -0.25]
    assert (first.input_ids.dtype, first.completion_mask.dtype) == (np.int64, np.int64)
    assert first.old_log_probs.dtype == np.float32
    assert (first.model_version, second.model_version) == (2, 3)  # the rollouts' own
    assert first.group_id == second.group_id == 7
    assert first.prompt == PROMPT
    assert first.metrics == {"reward": 1.0, "reward_std": 0.5, "reward_components/format": 1.0}
    assert first.advantage == pytest.approx(1.0) and second.advantage == pytest.approx(-1.0)
    assert first.completion == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "get_weather", "arguments": '{"city": "sf"}'}],
        },
        {"role": "tool", "content": "cold"},
        {"role": "assistant", "content": "Cold."},
    ]


def test_failed_and_stale_rollouts_are_left_out_and_small_groups_dropped():
    unstitchable = rollout(1.0)
    del unstitchable.rollout.turns[:]  # no token ids: NO_TOKENS
    group = group_of(
        rollout(1.0), MASKED, unstitchable, rollout(0.0), rollout(0.5), versions=[5, 5, 5, 1, 2]
    )
    verdict = groups.close(group, version=5, max_staleness=3, min_group_size=2)
    assert sorted(verdict.failures) == [1, 2]
    assert verdict.failures[2].reason == "NO_TOKENS"
    assert verdict.stale == 1  # version 1 is 4 behind 5; version 2 is 3 behind: kept
    assert verdict.rewards == [1.0, 0.5] and not verdict.dropped
    assert all(not math.isnan(s.advantage) for s in verdict.samples)

    dropped = groups.close(group, version=6, max_staleness=3, min_group_size=2)
    assert dropped.dropped and dropped.samples == [] and dropped.stale == 2
    assert sorted(dropped.failures) == [1, 2]
