"""The `/run` bodies the bridge builds for agent servers and 0.7 environment servers, and the
checks of a RunRequest, without servers (the JSON shapes: test_run_replies.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.run_checks import check_body, check_run
from nemo_gym_grpc.bridge.nemo_gym.head import AGENT, ENVIRONMENT
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import rollout_pb2, verify_pb2
from tests.test_run_replies import PARAMS


def request(**fields: Any) -> rollout_pb2.RunRequest:
    return rollout_pb2.RunRequest(**({"request_id": "r1", "agent": "simple_agent"} | fields))


def test_the_agent_body_is_the_row_with_its_params_and_nulls_dropped():
    row = {"responses_create_params": PARAMS | {"temperature": None}, "city": "sf", "x": None}
    checked = check_body(request(row_json=json.dumps(row)), AGENT)
    assert json.loads(checked.payload) == {"responses_create_params": PARAMS, "city": "sf"}


def test_given_params_override_the_rows_and_a_prompt_fills_in_when_neither_has_them():
    given = check_body(
        request(
            row_json='{"responses_create_params": {"input": "a"}, "k": 1}',
            responses_create_params_json=json.dumps(PARAMS),
        ),
        AGENT,
    )
    assert json.loads(given.payload) == {"responses_create_params": PARAMS, "k": 1}
    prompt = check_body(
        request(
            prompt=[
                verify_pb2.Message(content="hi"),
                verify_pb2.Message(role="system", content="s"),
            ]
        ),
        AGENT,
    )
    assert json.loads(prompt.payload) == {
        "responses_create_params": {
            "input": [{"role": "user", "content": "hi"}, {"role": "system", "content": "s"}]
        }
    }


def test_the_episode_body_is_single_agent_turns_request_with_the_attempt_number():
    row = {"responses_create_params": PARAMS, "expected": "cold"}
    checked = check_body(
        request(request_id="q7-3", agent="env", row_json=json.dumps(row)), ENVIRONMENT
    )
    assert json.loads(checked.episode_body("q7-3", 2)) == {
        "episode_id": {"rollout_id": "q7-3", "attempt": 2},
        "task": {
            "task_id": {"taskset": "env", "task_id": "q7-3"},
            "task_input": {"responses_create_params": PARAMS, "task_data": {"expected": "cold"}},
        },
    }
    named = check_body(
        request(taskset="weather:v1", task_id="t9", task_input_json='{"prompt": "p"}'),
        ENVIRONMENT,
    )
    assert json.loads(named.episode_body("r1", 0))["task"] == {
        "task_id": {"taskset": "weather:v1", "task_id": "t9"},
        "task_input": {"prompt": "p"},
    }


@pytest.mark.parametrize("rollout_id", ["bad/id", ".dot", "ends-a1", "ends-a12", "ü"])
def test_an_environment_rollout_needs_a_valid_episode_rollout_id(rollout_id):
    with pytest.raises(errors.ItemError) as failed:
        check_body(request(request_id=rollout_id), ENVIRONMENT)
    assert failed.value.code == code_pb2.INVALID_ARGUMENT
    assert failed.value.metadata["field"] == "request_id"
    check_body(request(request_id=rollout_id), AGENT)  # any id is fine for an agent


def test_ids_like_nemo_gyms_own_pass_as_rollout_ids():
    for rollout_id in ("0-0", "task.7_r-2", "x-a0", "A"):
        check_body(request(request_id=rollout_id), ENVIRONMENT)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"agent": ""}, "agent"),
        ({"timeout_seconds": -1.0}, "timeout_seconds"),
        ({"timeout_seconds": float("nan")}, "timeout_seconds"),
    ],
)
def test_a_rollout_without_an_id_or_agent_or_a_bad_timeout_is_invalid(fields, field):
    with pytest.raises(errors.ItemError) as failed:
        check_run(request(**fields), max_item_bytes=1 << 20)
    assert (failed.value.code, failed.value.metadata["field"]) == (code_pb2.INVALID_ARGUMENT, field)


@pytest.mark.parametrize(
    "fields",
    [
        {"row_json": "[1]"},
        {"row_json": "{"},
        {"responses_create_params_json": '"x"'},
        {"task_input_json": "[]"},
        {"row_json": '{"x": NaN}'},
        {"row_json": '{"x": "\\ud800"}'},
    ],
)
def test_json_fields_must_be_objects_that_can_be_sent(fields):
    with pytest.raises(errors.ItemError) as failed:
        check_body(request(**fields), ENVIRONMENT)
    assert failed.value.code == code_pb2.INVALID_ARGUMENT


def test_a_rollout_over_the_size_limit_is_too_large():
    with pytest.raises(errors.ItemError) as failed:
        check_run(request(row_json=json.dumps({"x": "y" * 2000})), max_item_bytes=1000)
    assert failed.value.reason == reasons.ITEM_TOO_LARGE
