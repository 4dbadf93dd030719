"""The axolotl plugin's parts that need no axolotl (fast tier): one NeMo Gym reward function
per trainer (`rewards/axolotl/wiring.py`) and rollouts -> the data producer's batch
(`rewards/axolotl/batch.py`). The plugin itself runs inside real axolotl in test_axolotl.py."""

from __future__ import annotations

import logging
import math
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")  # the test-trl group of `make dev` installs it

from nemo_gym_grpc.rewards import reward_env, reward_nemo_gym_verify  # noqa: E402
from nemo_gym_grpc.rewards.axolotl.batch import rollout_data  # noqa: E402
from nemo_gym_grpc.rewards.axolotl.wiring import install_reward, is_nemo_gym_reward  # noqa: E402


def user_reward(completions: Any, prompts: Any = None, **kwargs: Any) -> list[float]:
    return [0.5 for _ in completions]


def axolotls_reward_env(completions: Any, prompts: Any = None, **kwargs: Any) -> list[float]:
    return [0.0 for _ in completions]


axolotls_reward_env.__module__ = "axolotl.integrations.nemo_gym.rewards"


def trainer_with(*funcs: Any) -> Any:
    return types.SimpleNamespace(
        reward_funcs=list(funcs),
        reward_func_names=[f.__name__ for f in funcs],
        reward_processing_classes=[None] * len(funcs),
        reward_weights=torch.arange(1, len(funcs) + 1, dtype=torch.float32),
    )


def test_nemo_gym_reward_functions_are_ours_and_axolotls():
    assert is_nemo_gym_reward(reward_nemo_gym_verify) and is_nemo_gym_reward(reward_env)
    assert is_nemo_gym_reward(axolotls_reward_env)
    assert not is_nemo_gym_reward(user_reward) and not is_nemo_gym_reward("nemo_gym_grpc.x")


def test_the_plugins_function_replaces_every_listed_one_in_the_first_ones_place(caplog):
    trainer = trainer_with(reward_nemo_gym_verify, user_reward, axolotls_reward_env)
    with caplog.at_level(logging.INFO, logger="nemo_gym_grpc.rewards.axolotl"):
        replaced = install_reward(trainer, reward_env)
    assert trainer.reward_funcs == [reward_env, user_reward]
    assert trainer.reward_func_names == ["nemo_gym", "user_reward"]
    assert trainer.reward_processing_classes == [None, None]
    assert trainer.reward_weights.tolist() == [1.0, 2.0]  # each column keeps its weight
    assert replaced == [
        "nemo_gym_grpc.rewards.trl.functions.reward_nemo_gym_verify",
        "axolotl.integrations.nemo_gym.rewards.axolotls_reward_env",
    ]
    (record,) = caplog.records  # said once
    assert "takes the place of the first" in record.getMessage()


def test_without_a_listed_one_the_plugins_function_is_appended_with_weight_1(caplog):
    trainer = trainer_with(user_reward)
    with caplog.at_level(logging.INFO, logger="nemo_gym_grpc.rewards.axolotl"):
        assert install_reward(trainer, reward_env) == []
    assert trainer.reward_funcs == [user_reward, reward_env]
    assert trainer.reward_func_names == ["user_reward", "nemo_gym"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0]
    assert not caplog.records


def test_reward_lists_of_different_lengths_are_an_error():
    trainer = trainer_with(user_reward)
    trainer.reward_func_names.append("extra")
    with pytest.raises(ValueError, match="differ in length"):
        install_reward(trainer, reward_env)


def test_a_failed_rollout_enters_the_batch_nan_and_fully_masked():
    output = {
        "prompt_ids": [[5, 6, 7], [2]],
        "completion_ids": [[8, 9, 10, 11], [2]],
        "logprobs": [[-0.5, 0.0, -0.25, -1.0], [0.0]],
        "env_mask": [[1, 0, 1, 1], [0]],
        "env_reward": [1.0, math.nan],
        "num_turns": [2, 0],
        "rollout_error": [None, "NOT_FOUND (UNKNOWN_AGENT)"],
    }
    inputs = [{"prompt": "p0", "verify_extra": {}}, {"prompt": "p1", "verify_extra": {}}]
    data = rollout_data(
        output,
        inputs,
        pad_token_id=0,
        decode=lambda ids: [f"text{len(row)}" for row in ids.tolist()],
        rank0_only=False,
    )
    assert data["prompt_ids"].tolist() == [[5, 6, 7], [0, 0, 2]]  # left-padded
    assert data["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert data["completion_ids"].tolist() == [[8, 9, 10, 11], [2, 0, 0, 0]]
    assert data["completion_mask"].tolist() == [[1, 1, 1, 1], [0, 0, 0, 0]]
    assert data["tool_mask"].tolist() == [[1, 0, 1, 1], [0, 1, 1, 1]]
    assert data["sampling_per_token_logps"].tolist() == [[-0.5, 0.0, -0.25, -1.0], [0, 0, 0, 0]]
    assert int(data["num_items_in_batch"]) == 4
    assert data["advantages"].tolist() == [0.0, 0.0]
    deferred = data["_deferred_inputs"]
    assert [row["env_reward"] for row in deferred][0] == 1.0
    assert math.isnan(deferred[1]["env_reward"]) and deferred[1]["num_turns"] == 0
    assert deferred[1]["rollout_error"] == "NOT_FOUND (UNKNOWN_AGENT)"
    assert "env_reward" not in inputs[0]  # the dataloader's rows are not changed
    assert data["_deferred_prompts"] == ["p0", "p1"]
    assert data["_deferred_completions"] == ["text4", "text4"]
    assert data["_deferred_completion_ids_list"] == [[8, 9, 10, 11], [2]]
    assert data["_pending_policy_logps"] is True and data["_rank0_only"] is False


def test_rollout_output_columns_of_another_length_are_an_error():
    output = {"prompt_ids": [[1]], "completion_ids": [[1], [2]], "rollout_error": [None]}
    with pytest.raises(ValueError, match="must have 1 entries"):
        rollout_data(output, [{}], pad_token_id=0, decode=list, rank0_only=False)
