"""Rollouts through a real bridge process in front of the real NeMo Gym agent stack
(tests/support/agents.py: simple_agent + vllm_model over the scripted policy +
example_single_tool_call; on 0.7 the single_agent_turn environment server and the masked
math_agent): Run, RunStream and ListAgents over real gRPC, agents given statically and
discovered from the head server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import rollout_pb2
from tests.support import AgentStack, BridgeProcess, closed_port, example_rows, start_bridge
from tests.support.agents import (
    EPISODE_SERVER,
    MASKED_AGENT,
    MASKED_RELAY,
    MASKED_RESOURCES,
    WEATHER_AGENT,
    WEATHER_RESOURCES,
)
from tests.support.items import error_info
from tests.support.rollouts import RUN_DEADLINE, by_id, rollout_stub, run_request, weather_turns
from tests.support.versions import version_tuple


@pytest.fixture(scope="module")
def weather_row(agent_stack: AgentStack) -> dict[str, Any]:
    return example_rows(WEATHER_RESOURCES)[0]


@pytest.fixture(scope="module")
def static_bridge(agent_stack: AgentStack) -> Iterator[BridgeProcess]:
    """A bridge with every agent of the stack given by --agent / --environment-server, plus
    `down` (a closed port)."""
    args = ["--agent", f"{WEATHER_AGENT}={agent_stack.agent_urls[WEATHER_AGENT]}"]
    args += ["--agent", f"down=http://127.0.0.1:{closed_port()}"]
    if MASKED_AGENT in agent_stack.agent_urls:
        args += ["--agent", f"{MASKED_AGENT}={agent_stack.agent_urls[MASKED_AGENT]}"]
    if EPISODE_SERVER in agent_stack.environment_urls:
        url = agent_stack.environment_urls[EPISODE_SERVER]
        args += ["--environment-server", f"{EPISODE_SERVER}={url}"]
    with start_bridge(*args) as bridge:
        yield bridge


@pytest.fixture(autouse=True)
def _policy_defaults(agent_stack: AgentStack) -> Iterator[None]:
    agent_stack.policy.reset()
    yield
    agent_stack.policy.reset()


def assert_weather_rollout(result: rollout_pb2.RunResponse, row: dict[str, Any]) -> None:
    """A weather rollout of `row` that scored 1.0, with its output and both model calls'
    tokens as the scripted policy's tokenizer predicts them."""
    assert result.WhichOneof("outcome") == "rollout", result.error
    rollout = result.rollout
    assert rollout.reward == 1.0
    assert (rollout.failure_kind, rollout.failure_reason, rollout.verification_skipped) == (
        "",
        "",
        False,
    )
    output = json.loads(rollout.output_json)
    assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
    turns = [
        (list(t.prompt_token_ids), list(t.generation_token_ids), list(t.generation_log_probs))
        for t in rollout.turns
    ]
    assert turns == weather_turns(row, output[1]["output"])
    assert result.latency_seconds > 0


def test_run_on_a_static_agent_gives_reward_turns_and_output(static_bridge, weather_row):
    with rollout_stub(static_bridge) as stub:
        result = stub.Run(run_request("w1", WEATHER_AGENT, weather_row), timeout=RUN_DEADLINE)
        assert result.request_id == "w1"
        assert_weather_rollout(result, weather_row)
        assert result.rollout.reply_json == ""
        kept = stub.Run(
            run_request("w2", WEATHER_AGENT, weather_row, include_reply=True), timeout=RUN_DEADLINE
        )
    reply = json.loads(kept.rollout.reply_json)
    assert not {"reward", "response", "responses_create_params"} & set(reply)


def test_the_prompt_and_params_fields_build_the_row(static_bridge, weather_row):
    params = weather_row["responses_create_params"]
    with rollout_stub(static_bridge) as stub:
        result = stub.Run(
            run_request(
                "w-params",
                WEATHER_AGENT,
                {"responses_create_params": {"input": "ignored"}},
                responses_create_params_json=json.dumps(params),
            ),
            timeout=RUN_DEADLINE,
        )
    assert_weather_rollout(result, weather_row)


def test_agents_are_discovered_from_the_head_server_with_their_protocol(
    agent_stack, agent_bridge, weather_row
):
    with rollout_stub(agent_bridge) as stub:
        listed = stub.ListAgents(rollout_pb2.ListAgentsRequest(refresh=True), timeout=30)
        agents = {a.name: a for a in listed.agents}
        assert agents[WEATHER_AGENT].protocol == "agent"
        assert agents[WEATHER_AGENT].source == "head_server"
        assert list(agents[WEATHER_AGENT].upstream_urls) == [agent_stack.agent_urls[WEATHER_AGENT]]
        if version_tuple(agent_stack.version) >= (0, 7):
            assert agents[EPISODE_SERVER].protocol == "environment"
            assert agents[MASKED_RELAY].protocol == "agent"  # a legacy_agent relay: flat rows
        assert WEATHER_RESOURCES not in agents  # resources servers are no agents
        result = stub.Run(run_request("d1", WEATHER_AGENT, weather_row), timeout=RUN_DEADLINE)
    assert_weather_rollout(result, weather_row)


@pytest.mark.nemo_gym_07
def test_an_environment_server_episode_gives_the_reward_with_turns(static_bridge, weather_row):
    with rollout_stub(static_bridge) as stub:
        result = stub.Run(
            run_request("episode-1", EPISODE_SERVER, weather_row, include_reply=True),
            timeout=RUN_DEADLINE,
        )
    assert_weather_rollout(result, weather_row)
    assert "ng_agent_observations" in json.loads(result.rollout.reply_json)


@pytest.mark.nemo_gym_07
def test_an_episode_that_fails_in_the_agent_stage_says_so(agent_stack, static_bridge, weather_row):
    agent_stack.policy.knobs.status = 500  # every model call fails
    with rollout_stub(static_bridge) as stub:
        result = stub.Run(
            run_request("episode-2", EPISODE_SERVER, weather_row), timeout=RUN_DEADLINE
        )
    assert result.error.code == code_pb2.INTERNAL
    info = error_info(result)
    assert info.reason == reasons.UPSTREAM_EPISODE_FAILED
    assert info.metadata["stage"] == "agent"
    assert info.metadata["terminal"] in ("true", "false")
    assert info.metadata["failureReason"]
    assert info.metadata["attempts"] == "1"


@pytest.mark.nemo_gym_07
def test_an_invalid_episode_rollout_id_fails_before_any_call(static_bridge, weather_row):
    with rollout_stub(static_bridge) as stub:
        result = stub.Run(run_request("bad/id", EPISODE_SERVER, weather_row), timeout=RUN_DEADLINE)
    assert result.error.code == code_pb2.INVALID_ARGUMENT
    assert error_info(result).metadata["field"] == "request_id"


@pytest.mark.nemo_gym_07
def test_a_masked_rollout_is_an_unknown_error_with_its_failure_kind(static_bridge):
    row = example_rows(MASKED_RESOURCES)[0]
    with rollout_stub(static_bridge) as stub:
        result = stub.Run(run_request("m1", MASKED_AGENT, row), timeout=RUN_DEADLINE)
    assert result.error.code == code_pb2.UNKNOWN
    info = error_info(result)
    assert info.reason == reasons.UPSTREAM_MASKED_SAMPLE
    assert info.metadata["failureKind"] == "judge_failed"
    assert info.metadata["failureReason"]


def test_runstream_gives_every_item_exactly_one_result(agent_stack, static_bridge, weather_row):
    full = version_tuple(agent_stack.version) >= (0, 7)
    expected = {f"w{i}": "rollout" for i in range(6)}
    items = [run_request(i, WEATHER_AGENT, weather_row) for i in expected]
    items.append(run_request("unknown", "no_such_agent", weather_row))
    items.append(run_request("down", "down", weather_row))
    items.append(run_request("", WEATHER_AGENT, weather_row))  # no id: refused alone
    expected |= {"unknown": "NOT_FOUND", "down": "UNAVAILABLE", "": "INVALID_ARGUMENT"}
    if full:
        items.append(run_request("masked", MASKED_AGENT, example_rows(MASKED_RESOURCES)[0]))
        items.append(run_request("episode-3", EPISODE_SERVER, weather_row))
        expected |= {"masked": "UNKNOWN", "episode-3": "rollout"}
    batches = [
        rollout_pb2.RunStreamRequest(items=items[:4]),
        rollout_pb2.RunStreamRequest(items=items[4:]),
    ]
    with rollout_stub(static_bridge) as stub:
        results = by_id(stub.RunStream(iter(batches), timeout=RUN_DEADLINE))
    outcomes = {
        rid: "rollout" if r.HasField("rollout") else code_pb2.Code.Name(r.error.code)
        for rid, r in results.items()
    }
    assert outcomes == expected
    for rid, kind in expected.items():
        if kind == "rollout":
            assert_weather_rollout(results[rid], weather_row)


def test_a_duplicate_request_id_in_flight_is_refused_alone(agent_stack, static_bridge, weather_row):
    agent_stack.policy.knobs.delay = 0.5  # the first is still in flight when the second arrives
    batch = rollout_pb2.RunStreamRequest(
        items=[run_request("same", WEATHER_AGENT, weather_row)] * 2
    )
    with rollout_stub(static_bridge) as stub:
        messages = list(stub.RunStream(iter([batch]), timeout=RUN_DEADLINE))
    results = [r for m in messages for r in m.results]
    assert sorted(r.WhichOneof("outcome") for r in results) == ["error", "rollout"]
    refused = next(r for r in results if r.HasField("error"))
    assert refused.error.code == code_pb2.INVALID_ARGUMENT


def test_an_unparsable_run_request_is_invalid_argument(static_bridge):
    bad = b"\x0a\x02\xff\xfe"  # field 1 (request_id) holding invalid UTF-8
    with grpc.insecure_channel(static_bridge.target) as channel:
        call = channel.unary_unary(
            "/nemo_gym_grpc.v1.RolloutService/Run",
            request_serializer=lambda raw: raw,
            response_deserializer=rollout_pb2.RunResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as refused:
            call(bad, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
