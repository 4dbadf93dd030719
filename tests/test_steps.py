"""A step-wise server's `/step` reply read into a StepResult (bridge/nemo_gym/steps.py): NeMo
Gym 0.7's `EnvStepResponse` shapes, and the replies that are no usable step."""

from __future__ import annotations

import json

import pytest

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym.steps import read_step_reply

URL = "http://127.0.0.1:1/step"


def read(reply: dict):
    return read_step_reply(json.dumps(reply).encode(), URL)


def test_a_step_and_the_last_step_of_an_episode():
    going = read({"observation": "Your hand: [8, 5, 3]", "reward": 0.0, "info": {}})
    assert going.observation == "Your hand: [8, 5, 3]" and going.reward == 0.0
    assert not going.terminated and not going.truncated and json.loads(going.info_json) == {}
    last = read({"observation": None, "reward": -1.0, "terminated": True, "info": {"r": "bust"}})
    assert not last.HasField("observation") and last.terminated and last.reward == -1.0
    assert json.loads(last.info_json) == {"r": "bust"}


@pytest.mark.parametrize(
    "reply",
    [
        {"observation": "x"},  # no reward: never a 0.0 made up
        {"reward": "1"},
        {"reward": float("nan")},
        {"reward": 1.0, "terminated": "yes"},
        {"reward": 1.0, "observation": 3},
        {"reward": 1.0, "info": []},
    ],
)
def test_a_reply_that_is_no_usable_step_is_a_bad_reply(reply):
    with pytest.raises(errors.ItemError) as failed:
        read(reply)
    assert failed.value.reason == "UPSTREAM_BAD_REPLY"


def test_a_masked_step_is_no_reward():
    with pytest.raises(errors.ItemError) as failed:
        read({"reward": 0.0, "mask_sample": True, "failure_kind": "judge_failed"})
    assert failed.value.reason == "UPSTREAM_JUDGE_FAILED"
