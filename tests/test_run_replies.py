"""The rollout side of NeMo Gym's HTTP, without servers: how the bridge reads the replies of
agent servers and 0.7 environment servers to `/run`, and discovers them (the bodies it sends:
test_run_bodies.py).

The JSON shapes are NeMo Gym 0.7.0's: an agent `/run` reply is the resources server's
`/verify` reply (`resources_servers/example_single_tool_call/data/example_rollouts.jsonl`),
with `vllm_model`'s token fields on the last output item of each model call
(`responses_api_agents/simple_agent/tests/test_app.py`, `nemo_gym/responses_converter.py`);
episodes are `nemo_gym/episode_types.py`'s `BaseEpisodeRequest` / `BaseEpisodeResponse`, and
the failures are those `base_environment_server.py` returns.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym.episodes import read_episode_reply
from nemo_gym_grpc.bridge.nemo_gym.head import AGENT_SERVERS, list_servers, load_config
from nemo_gym_grpc.bridge.nemo_gym.run import read_rollout
from nemo_gym_grpc.bridge.nemo_gym.scores import parse_reply
from nemo_gym_grpc.shared import reasons

URL = "http://127.0.0.1:9/run"
TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": ""}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
        "type": "function",
        "description": "",
    }
]
PARAMS = {
    "input": [
        {"content": "You are a helpful personal assistant.", "role": "developer"},
        {"content": "what's it like in sf?", "role": "user"},
    ],
    "tools": TOOLS,
}
# The output of a rollout with one tool call, as simple_agent over vllm_model returns it.
OUTPUT: list[dict[str, Any]] = [
    {
        "arguments": '{"city": "sf"}',
        "call_id": "call_1",
        "name": "get_weather",
        "type": "function_call",
        "id": "call_1",
        "status": "completed",
        "prompt_token_ids": [10, 11, 12],
        "generation_token_ids": [13, 14],
        "generation_log_probs": [-0.5, -0.25],
    },
    {
        "call_id": "call_1",
        "output": '{"city": "sf", "weather_description": "cold"}',
        "type": "function_call_output",
    },
    {
        "id": "msg_2",
        "content": [{"annotations": [], "text": "It is cold in sf.", "type": "output_text"}],
        "role": "assistant",
        "status": "completed",
        "type": "message",
        "prompt_token_ids": [10, 11, 12, 13, 14, 20, 21],
        "generation_token_ids": [30],
        "generation_log_probs": [-0.125],
    },
]


def run_reply(**fields: Any) -> dict[str, Any]:
    """An agent `/run` reply (0.7: `mask_sample`, `failure_kind`, `failure_reason` on every
    reply)."""
    reply = {
        "responses_create_params": PARAMS,
        "response": {"id": "resp_1", "object": "response", "output": OUTPUT, "model": "policy"},
        "reward": 1.0,
        "mask_sample": False,
        "failure_kind": None,
        "failure_reason": None,
    }
    return reply | fields


# --- agent replies ------------------------------------------------------------------------


def test_a_run_reply_gives_the_reward_the_output_and_one_turn_per_model_call():
    ran = read_rollout(run_reply(reward_components={"format": 0.5}), URL, include_reply=False)
    assert ran.scored.reward == 1.0
    assert ran.scored.components == {"format": 0.5}
    assert json.loads(ran.output_json) == OUTPUT
    assert [
        (t.prompt_token_ids, t.generation_token_ids, t.generation_log_probs) for t in ran.turns
    ] == [
        ([10, 11, 12], [13, 14], [-0.5, -0.25]),
        ([10, 11, 12, 13, 14, 20, 21], [30], [-0.125]),
    ]
    assert not ran.verification_skipped
    assert ran.scored.reply_json == ""


def test_include_reply_keeps_the_other_fields_and_a_policy_without_tokens_gives_no_turns():
    plain = [
        {k: v for k, v in item.items() if not k.startswith(("prompt_", "generation_"))}
        for item in OUTPUT
    ]
    reply = run_reply(response={"output": plain}, city="sf", verification_skipped=True)
    ran = read_rollout(reply, URL, include_reply=True)
    assert ran.turns == []
    assert ran.verification_skipped
    other = json.loads(ran.scored.reply_json)
    assert other["city"] == "sf" and "response" not in other and "reward" not in other


def test_a_masked_rollout_is_an_unknown_error_and_a_degraded_one_keeps_its_reward():
    with pytest.raises(errors.ItemError) as masked:
        read_rollout(
            run_reply(mask_sample=True, failure_kind="tool_error", failure_reason="boom"),
            URL,
            include_reply=False,
        )
    assert (masked.value.code, masked.value.reason) == (
        code_pb2.UNKNOWN,
        reasons.UPSTREAM_MASKED_SAMPLE,
    )
    assert masked.value.metadata["failureKind"] == "tool_error"
    assert masked.value.metadata["failureReason"] == "boom"
    for judge in ({"_ng_failure_class": "judge_failed"}, {"failure_kind": "judge_failed"}):
        with pytest.raises(errors.ItemError) as failed:  # a retry would be a new rollout
            read_rollout(run_reply(mask_sample=True, **judge), URL, include_reply=False)
        assert (failed.value.code, failed.value.reason) == (
            code_pb2.UNKNOWN,
            reasons.UPSTREAM_MASKED_SAMPLE,
        )
    degraded = read_rollout(
        run_reply(reward=0.0, failure_reason="browser session not found at verify"),
        URL,
        include_reply=False,
    )
    assert degraded.scored.reward == 0.0
    assert degraded.scored.failure_reason == "browser session not found at verify"


@pytest.mark.parametrize(
    "reply",
    [
        run_reply(reward=None),
        run_reply(reward="1"),
        run_reply(response={"output": {"not": "a list"}}),
        run_reply(response={"output": [OUTPUT[0] | {"generation_log_probs": [-1.0]}]}),
        run_reply(
            response={"output": [{k: v for k, v in OUTPUT[0].items() if k != "prompt_token_ids"}]}
        ),
        run_reply(response={"output": [OUTPUT[0] | {"generation_token_ids": ["a", "b"]}]}),
    ],
)
def test_a_reply_without_a_reward_or_with_broken_token_fields_is_internal(reply):
    with pytest.raises(errors.ItemError) as failed:
        read_rollout(reply, URL, include_reply=False)
    assert (failed.value.code, failed.value.reason) == (
        code_pb2.INTERNAL,
        reasons.UPSTREAM_BAD_REPLY,
    )


def test_a_body_that_is_no_json_object_is_a_bad_reply():
    for raw in (b"<html>", b"[1]"):
        with pytest.raises(errors.ItemError) as failed:
            parse_reply(raw, URL)
        assert failed.value.reason == reasons.UPSTREAM_BAD_REPLY


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (400, code_pb2.INVALID_ARGUMENT),
        (422, code_pb2.INVALID_ARGUMENT),
        (404, code_pb2.INVALID_ARGUMENT),
        (500, code_pb2.INTERNAL),
        (503, code_pb2.INTERNAL),
    ],
)
def test_agent_http_errors_are_final(status, code):
    error = errors.run_status_error(status, URL, b'{"detail": "x"}')
    assert (error.code, error.reason, error.retryable) == (code, reasons.UPSTREAM_HTTP_ERROR, False)
    assert error.metadata["httpStatus"] == str(status)


# --- episode replies ----------------------------------------------------------------------

EPISODE_ID = {"rollout_id": "r1", "attempt": 0}
TASK_ID = {"taskset": "env", "task_id": "r1"}


def episode(**fields: Any) -> bytes:
    return json.dumps({"episode_id": EPISODE_ID, "task_id": TASK_ID} | fields).encode()


def test_an_episode_result_is_read_as_a_run_reply():
    result = run_reply(ng_agent_observations={"source": "simple_agent", "records": []})
    ran = read_episode_reply(episode(result=result, failure=None), URL, include_reply=True)
    assert ran.scored.reward == 1.0 and len(ran.turns) == 2
    assert "ng_agent_observations" in json.loads(ran.scored.reply_json)


def test_an_admission_refusal_is_unavailable_and_retryable():
    failure = {
        "failure_reason": "Episode admission timed out",
        "terminal": False,
        "stage": "admission",
    }
    with pytest.raises(errors.ItemError) as failed:
        read_episode_reply(episode(result=None, failure=failure), URL, include_reply=False)
    error = failed.value
    assert (error.code, error.reason, error.retryable) == (
        code_pb2.UNAVAILABLE,
        reasons.UPSTREAM_EPISODE_FAILED,
        True,
    )
    assert error.metadata["stage"] == "admission"
    assert error.metadata["terminal"] == "false"
    assert error.metadata["failureReason"] == "Episode admission timed out"


@pytest.mark.parametrize(
    "failure",
    [
        {"failure_reason": "boom", "terminal": True, "stage": "agent", "failure_kind": "x"},
        {"failure_reason": "Episode timed out", "terminal": False},
        {"failure_reason": "lost close", "terminal": False, "stage": "cleanup"},
        {"failure_reason": "admitted, then", "terminal": True, "stage": "admission"},
    ],
)
def test_other_episode_failures_are_internal_and_final_with_their_stage(failure):
    with pytest.raises(errors.ItemError) as failed:
        read_episode_reply(episode(failure=failure), URL, include_reply=False)
    error = failed.value
    assert (error.code, error.retryable) == (code_pb2.INTERNAL, False)
    assert error.metadata.get("stage") == failure.get("stage")
    assert error.metadata["terminal"] == str(failure["terminal"]).lower()
    assert error.metadata.get("failureKind") == failure.get("failure_kind")


def test_a_masked_episode_result_is_unknown_and_a_reply_with_neither_is_bad():
    with pytest.raises(errors.ItemError) as masked:
        read_episode_reply(episode(result=run_reply(mask_sample=True)), URL, include_reply=False)
    assert masked.value.code == code_pb2.UNKNOWN
    for body in (episode(), episode(result=None, failure=None), episode(result=[1])):
        with pytest.raises(errors.ItemError) as bad:
            read_episode_reply(body, URL, include_reply=False)
        assert bad.value.reason == reasons.UPSTREAM_BAD_REPLY


# --- discovery ----------------------------------------------------------------------------


def test_agents_and_environment_servers_are_discovered_with_their_protocol():
    config = {
        "simple_agent": {
            "responses_api_agents": {
                "simple_agent": {"host": "0.0.0.0", "port": 5001, "resources_server": {"name": "w"}}
            }
        },
        "weather_env": {
            "environment_servers": {"single_agent_turn": {"host": "127.0.0.1", "port": 5002}}
        },
        "w": {
            "resources_servers": {"example_single_tool_call": {"host": "127.0.0.1", "port": 5003}}
        },
        "policy_model": {
            "responses_api_models": {"vllm_model": {"host": "127.0.0.1", "port": 5004}}
        },
        # 0.7's relay to an unmigrated agent takes the agent's flat row
        "relay": {"environment_servers": {"legacy_agent": {"host": "127.0.0.1", "port": 5005}}},
    }
    body = json.dumps(yaml.safe_dump(config)).encode()
    listing = list_servers(load_config(body), "http://127.0.0.2:11000", AGENT_SERVERS)
    assert listing.found == {
        "simple_agent": ("http://127.0.0.2:5001", "agent"),
        "weather_env": ("http://127.0.0.1:5002", "environment"),
        "single_agent_turn": ("http://127.0.0.1:5002", "environment"),
        "relay": ("http://127.0.0.1:5005", "agent"),
        "legacy_agent": ("http://127.0.0.1:5005", "agent"),
    }
