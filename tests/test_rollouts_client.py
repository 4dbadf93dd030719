"""The rollout client through a real bridge against the real NeMo Gym agent stack.

`run_rollouts` / `arun_rollouts` -> real gRPC `RunStream` -> a real bridge process (agents
discovered from the head server, plus a static `--agent` on a closed port) -> NeMo Gym's own
`simple_agent` over `example_single_tool_call` and `vllm_model`, whose upstream is the scripted
policy (tests/support/policy_model.py: the one stand-in, as no LLM runs here). The truth each
result is checked against is the agent itself: the same row posted to its `/run` over plain
HTTP, without our code (the policy is deterministic).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from nemo_gym_grpc.rewards import arun_rollouts, run_rollouts
from nemo_gym_grpc.rewards.client import settings
from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.rewards.client.stitch import stitch
from nemo_gym_grpc.rewards.trl.rollout_func import rollout_output
from nemo_gym_grpc.v1 import rollout_pb2
from tests.support import closed_port, example_rows
from tests.support import start_bridge as _start_bridge
from tests.support.agents import (
    EPISODE_SERVER,
    MASKED_AGENT,
    MASKED_RESOURCES,
    WEATHER_AGENT,
    WEATHER_RESOURCES,
)

DOWN_AGENT = "down_agent"


@pytest.fixture(scope="module")
def rollout_target(agent_stack) -> Iterator[str]:
    """A bridge routing the stack's agents (head server) and DOWN_AGENT (a closed port)."""
    down = f"{DOWN_AGENT}=http://127.0.0.1:{closed_port()}"
    with _start_bridge("--head-url", agent_stack.head_url, "--agent", down) as bridge:
        yield bridge.target


def weather_rows(venv: Path) -> list[dict[str, Any]]:
    """example_single_tool_call's own example rows, each naming the weather agent."""
    rows = example_rows(WEATHER_RESOURCES, venv)
    return [
        dict(row, agent_ref={"type": "responses_api_agents", "name": WEATHER_AGENT}) for row in rows
    ]


def masked_row(venv: Path) -> dict[str, Any]:
    """A math_with_judge example row for the agent whose judge is down (its rollouts come back
    with `mask_sample: true`)."""
    (row, *_) = example_rows(MASKED_RESOURCES, venv)
    return dict(row, agent_ref={"type": "responses_api_agents", "name": MASKED_AGENT})


def run_over_http(agent_stack, row: dict[str, Any]) -> dict[str, Any]:
    """What the agent itself replies to `row` (plain HTTP `/run`, no bridge)."""
    url = agent_stack.agent_urls[row["agent_ref"]["name"]]
    reply = requests.post(f"{url}/run", json=row, timeout=120)
    reply.raise_for_status()
    return reply.json()


def without_ids(value: Any) -> Any:
    """`value` without the `id` fields NeMo Gym makes anew for every reply (msg_<hex>, ...)."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k != "id"}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def token_turns(reply: dict[str, Any]) -> list[tuple[list[int], list[int], list[float]]]:
    """The per-call token information of an agent reply's output items, in order."""
    return [
        (item["prompt_token_ids"], item["generation_token_ids"], item["generation_log_probs"])
        for item in reply["response"]["output"]
        if item.get("generation_token_ids")
    ]


def _turns(rollout: rollout_pb2.Rollout) -> list[tuple[list[int], list[int], list[float]]]:
    return [
        (list(t.prompt_token_ids), list(t.generation_token_ids), list(t.generation_log_probs))
        for t in rollout.turns
    ]


def test_rows_come_back_as_the_agents_rollouts_with_rewards_and_token_ids(
    agent_stack, nemo_gym_venv, rollout_target
):
    rows = weather_rows(nemo_gym_venv)
    outcomes = run_rollouts(rows, target=rollout_target, batch_timeout=300)
    assert len(outcomes) == len(rows)
    for row, outcome in zip(rows, outcomes, strict=True):
        assert isinstance(outcome, rollout_pb2.RunResponse), outcome
        truth = run_over_http(agent_stack, row)
        rollout = outcome.rollout
        assert rollout.reward == truth["reward"]
        assert without_ids(json.loads(rollout.output_json)) == without_ids(
            truth["response"]["output"]
        )
        assert _turns(rollout) == token_turns(truth)
        assert len(rollout.turns) == 2  # the tool call, then the answer after its output
        sample = stitch(rollout.turns)
        assert 0 in sample.env_mask and 1 in sample.env_mask  # the tool output is masked
        assert outcome.latency_seconds > 0
    assert {o.rollout.reward for o in outcomes} == {1.0}  # type: ignore[union-attr]


def test_the_async_client_gives_the_same_rollouts(agent_stack, nemo_gym_venv, rollout_target):
    rows = weather_rows(nemo_gym_venv)[:2]
    sync = run_rollouts(rows, target=rollout_target, batch_timeout=300)
    asynchronous = asyncio.run(arun_rollouts(rows, target=rollout_target, batch_timeout=300))
    for a, b in zip(sync, asynchronous, strict=True):
        assert isinstance(a, rollout_pb2.RunResponse) and isinstance(b, rollout_pb2.RunResponse)
        assert (a.rollout.reward, _turns(a.rollout)) == (b.rollout.reward, _turns(b.rollout))


def test_each_row_gets_its_own_outcome_and_failures_are_typed(
    agent_stack, nemo_gym_venv, rollout_target
):
    weather = weather_rows(nemo_gym_venv)[0]
    rows = [
        weather,
        dict(weather, agent_ref={"name": DOWN_AGENT}),  # agent down
        dict(weather, agent_ref={"name": "no_such_agent"}),  # not routed
        masked_row(nemo_gym_venv),  # the judge is down: NeMo Gym masks the sample
        {k: v for k, v in weather.items() if k != "agent_ref"},  # no agent at all
    ]
    outcomes = run_rollouts(rows, target=rollout_target, batch_timeout=300)
    ok, down, unknown, masked, no_agent = outcomes
    assert isinstance(ok, rollout_pb2.RunResponse) and ok.rollout.reward == 1.0
    for failure, code in [
        (down, "UNAVAILABLE"),
        (unknown, "NOT_FOUND"),
        (masked, "UNKNOWN"),
        (no_agent, "INVALID_ARGUMENT"),
    ]:
        assert isinstance(failure, Failure), failure
        assert failure.code == code, failure
        assert not failure.whole_call
    assert masked.metadata.get("failureKind") == "judge_failed"  # type: ignore[union-attr]
    assert run_over_http(agent_stack, rows[3]).get("mask_sample") is True  # the agent's own say

    # in TRL's rollout_func shape: failures get NaN (never 0.0) and a masked EOS completion
    output = rollout_output(outcomes, eos=2)
    assert output["env_reward"][0] == 1.0
    assert all(math.isnan(r) for r in output["env_reward"][1:])
    assert output["env_mask"][1:] == [[0]] * 4
    assert output["completion_ids"][1:] == [[2]] * 4
    assert output["rollout_error"][0] is None
    assert output["rollout_error"][3].startswith("UNKNOWN")


def test_a_rollout_past_its_time_limit_fails_alone_with_deadline_exceeded(
    agent_stack, nemo_gym_venv, rollout_target
):
    rows = weather_rows(nemo_gym_venv)[:1]
    agent_stack.policy.knobs.delay = 3.0
    try:
        (outcome,) = run_rollouts(rows, target=rollout_target, batch_timeout=60, run_timeout=1.0)
    finally:
        agent_stack.policy.reset()
    assert isinstance(outcome, Failure), outcome
    assert outcome.code == "DEADLINE_EXCEEDED" and not outcome.whole_call


def test_a_call_past_its_deadline_ends_every_rollout_in_it_with_deadline_exceeded(
    agent_stack, nemo_gym_venv, rollout_target
):
    rows = weather_rows(nemo_gym_venv)[:3]
    agent_stack.policy.knobs.delay = 5.0
    try:
        outcomes = run_rollouts(rows, target=rollout_target, batch_timeout=2.0)
    finally:
        agent_stack.policy.reset()
    # each one: the bridge cuts every /run to the call's deadline (less 50 ms), so the
    # rollouts fail on their own just before the call would
    assert all(isinstance(o, Failure) for o in outcomes)
    assert [o.code for o in outcomes] == ["DEADLINE_EXCEEDED"] * 3  # type: ignore[union-attr]


def test_agent_down_and_unknown_agent_fail_their_rollouts_alone(start_bridge):
    """No NeMo Gym needed: a bridge whose only agent is a closed port."""
    bridge = start_bridge("--agent", f"{DOWN_AGENT}=http://127.0.0.1:{closed_port()}")
    rows = [
        {"responses_create_params": {"input": "hi"}},
        {"agent_ref": {"name": "no_such_agent"}, "responses_create_params": {"input": "hi"}},
    ]
    down, unknown = run_rollouts(rows, agent=DOWN_AGENT, target=bridge.target, batch_timeout=60)
    assert isinstance(down, Failure) and isinstance(unknown, Failure)
    assert (down.code, down.reason, down.whole_call) == (
        "UNAVAILABLE",
        "UPSTREAM_UNAVAILABLE",
        False,
    )
    assert (unknown.code, unknown.reason) == ("NOT_FOUND", "UNKNOWN_AGENT")


def test_the_token_setting_reaches_the_rollout_call(start_bridge, monkeypatch):
    """The bridge requires a token: without it every rollout fails UNAUTHENTICATED (the whole
    call); with NEMO_GYM_GRPC_TOKEN set, as for scoring, the rollouts are run."""
    token = "rollout-test-token"
    bridge = start_bridge(
        "--agent", f"{DOWN_AGENT}=http://127.0.0.1:{closed_port()}", env={settings.TOKEN_ENV: token}
    )
    rows = [{"responses_create_params": {"input": "hi"}}]
    monkeypatch.delenv(settings.TOKEN_ENV, raising=False)
    (refused,) = run_rollouts(rows, agent=DOWN_AGENT, target=bridge.target, batch_timeout=60)
    assert isinstance(refused, Failure)
    assert (refused.code, refused.whole_call) == ("UNAUTHENTICATED", True)
    monkeypatch.setenv(settings.TOKEN_ENV, token)
    (ran,) = asyncio.run(
        arun_rollouts(rows, agent=DOWN_AGENT, target=bridge.target, batch_timeout=60)
    )
    assert isinstance(ran, Failure) and ran.code == "UNAVAILABLE"  # it reached the agent


def test_a_row_runs_as_an_episode_of_an_environment_server(
    agent_stack, nemo_gym_venv, rollout_target
):
    """NeMo Gym 0.7's single_agent_turn runs the row as a typed episode over the same agent."""
    (row, *_) = example_rows(WEATHER_RESOURCES, nemo_gym_venv)
    (outcome,) = run_rollouts([row], agent=EPISODE_SERVER, target=rollout_target, batch_timeout=300)
    if not agent_stack.environment_urls:  # NeMo Gym 0.4: no environment servers to route to
        assert isinstance(outcome, Failure) and outcome.code == "NOT_FOUND"
        return
    assert isinstance(outcome, rollout_pb2.RunResponse), outcome
    assert outcome.rollout.reward == 1.0
    assert len(outcome.rollout.turns) == 2
    assert stitch(outcome.rollout.turns).num_turns == 2
