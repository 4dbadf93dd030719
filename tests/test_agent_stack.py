"""The agent stack harness itself (tests/support/agents.py), over raw HTTP: real NeMo Gym
simple_agent, vllm_model, example_single_tool_call, math_with_judge and (0.7) the
single_agent_turn environment server, with the scripted policy as the only stand-in.

What the other rollout tests rely on: an agent `/run` on a weather row scores 1.0 with the
items function_call, function_call_output, message, whose token ids are exactly what the toy
tokenizer predicts (prefix-stable across turns); the 0.7 episode `/run` gives `result` with the
reward, or `failure` with its stage; the masked agent's `/run` says `mask_sample: true`; the
policy's delay / hold / status knobs reach the rollout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.support import AgentStack, Knobs, example_rows, toy_chat
from tests.support.agents import (
    EPISODE_SERVER,
    MASKED_AGENT,
    MASKED_RELAY,
    MASKED_RESOURCES,
    WEATHER_AGENT,
    WEATHER_RESOURCES,
)
from tests.support.policy_model import (
    FORECAST_PREFIX,
    WEATHER_ARGUMENTS,
    WEATHER_TOOL,
    WRONG_MATH_ANSWER,
)
from tests.support.versions import version_tuple

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)

TIMEOUT = 120.0  # s, any one HTTP call of these tests
CLOSE_WAIT = 5.0  # s, how long 0.4.0's held model call is watched for a close that never comes


@pytest.fixture
def http(agent_stack: AgentStack) -> Iterator[requests.Session]:
    """A loopback session; the policy's knobs and log are reset before and after the test."""
    agent_stack.policy.reset()
    with requests.Session() as session:
        session.trust_env = False
        yield session
    agent_stack.policy.reset()


@pytest.fixture(scope="module")
def weather_row(agent_stack: AgentStack) -> dict[str, Any]:
    return example_rows(WEATHER_RESOURCES)[0]


def _expected_turns(row: dict[str, Any], tool_output: str) -> list[dict[str, list[Any]]]:
    """The token ids of the two model turns of a weather rollout, from the toy tokenizer."""
    params = row["responses_create_params"]
    messages = [{"role": m["role"], "content": m["content"]} for m in params["input"]]
    tools = params["tools"]
    call = {"function": {"name": WEATHER_TOOL, "arguments": WEATHER_ARGUMENTS}}
    first = {"role": "assistant", "content": None, "tool_calls": [call]}
    answer = {"role": "assistant", "content": f"{FORECAST_PREFIX} The weather in sf is cold."}
    history = [*messages, first, {"role": "tool", "content": tool_output}]
    turns: list[dict[str, list[Any]]] = []
    for prompt_messages, message in ((messages, first), (history, answer)):
        generated = toy_chat.generation_token_ids(message)
        turns.append(
            {
                "prompt_token_ids": toy_chat.prompt_token_ids(prompt_messages, tools),
                "generation_token_ids": generated,
                "generation_log_probs": toy_chat.log_probs(generated),
            }
        )
    return turns


def _episode(row: dict[str, Any], rollout_id: str) -> dict[str, Any]:
    """A single_agent_turn episode request for `row` (attempt 0)."""
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": 0},
        "task": {
            "task_id": {"taskset": f"{WEATHER_RESOURCES}:example", "task_id": "0"},
            "task_input": {
                "responses_create_params": row["responses_create_params"],
                "task_data": {},
            },
        },
    }


def _token_fields(item: dict[str, Any]) -> dict[str, list[Any]]:
    keys = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    return {k: item[k] for k in keys}


def test_a_weather_rollout_scores_1_with_the_predicted_token_ids(
    agent_stack: AgentStack, http: requests.Session, weather_row: dict[str, Any]
) -> None:
    reply = http.post(
        f"{agent_stack.agent_urls[WEATHER_AGENT]}/run", json=weather_row, timeout=TIMEOUT
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["reward"] == 1.0
    if version_tuple(agent_stack.version) >= (0, 7):
        assert (body["mask_sample"], body["failure_kind"]) == (False, None)
    output = body["response"]["output"]
    assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
    call, tool_output, message = output
    assert (call["name"], call["arguments"]) == (WEATHER_TOOL, WEATHER_ARGUMENTS)
    assert tool_output["call_id"] == call["call_id"]
    assert "prompt_token_ids" not in tool_output
    assert message["content"][0]["text"].startswith(FORECAST_PREFIX)

    expected = _expected_turns(weather_row, tool_output["output"])
    assert [_token_fields(call), _token_fields(message)] == expected
    # prefix-stable: turn 2's prompt extends turn 1's prompt + generation by the tool output
    first, second = expected
    prefix = first["prompt_token_ids"] + first["generation_token_ids"]
    assert second["prompt_token_ids"][: len(prefix)] == prefix
    assert all(max(t["prompt_token_ids"]) < toy_chat.VOCAB_SIZE for t in expected)
    assert len(agent_stack.policy.chat_calls()) == 2


@pytest.mark.nemo_gym_07
def test_an_episode_gives_the_reward_as_its_result(
    agent_stack: AgentStack, http: requests.Session, weather_row: dict[str, Any]
) -> None:
    episode = _episode(weather_row, "weather-0")
    url = f"{agent_stack.environment_urls[EPISODE_SERVER]}/run"
    reply = http.post(url, json=episode, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["episode_id"] == episode["episode_id"]
    assert body["task_id"] == episode["task"]["task_id"]
    assert body.get("failure") is None
    result = body["result"]
    assert (result["reward"], result["mask_sample"]) == (1.0, False)
    output = result["response"]["output"]
    assert [i["type"] for i in output] == ["function_call", "function_call_output", "message"]
    assert _token_fields(output[0])["generation_token_ids"] == toy_chat.generation_token_ids(
        {"tool_calls": [{"function": {"name": WEATHER_TOOL, "arguments": WEATHER_ARGUMENTS}}]}
    )

    # the policy answers 500 on every call: the agent stage fails, and says so
    agent_stack.policy.reset()
    agent_stack.policy.knobs = Knobs(status=500)
    episode["episode_id"] = {"rollout_id": "weather-1", "attempt": 0}
    reply = http.post(url, json=episode, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body.get("result") is None
    failure = body["failure"]
    assert failure["stage"] == "agent"
    assert failure["failure_reason"]
    assert isinstance(failure["terminal"], bool)
    assert {c.status for c in agent_stack.policy.chat_calls()} == {500}


@pytest.mark.nemo_gym_07
def test_the_masked_agent_reports_mask_sample_directly_and_through_its_relay(
    agent_stack: AgentStack, http: requests.Session
) -> None:
    row = example_rows(MASKED_RESOURCES)[0]
    for url in (agent_stack.agent_urls[MASKED_AGENT], agent_stack.environment_urls[MASKED_RELAY]):
        hits = agent_stack.policy.judge_hits
        reply = http.post(f"{url}/run", json=row, timeout=TIMEOUT)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert (body["mask_sample"], body["failure_kind"]) == (True, "judge_failed")
        assert body["failure_reason"]
        text = body["response"]["output"][-1]["content"][0]["text"]
        assert text == WRONG_MATH_ANSWER
        assert agent_stack.policy.judge_hits > hits  # the judge was asked, and answered 503


def test_a_held_policy_call_holds_the_rollout_until_released(
    agent_stack: AgentStack, http: requests.Session, weather_row: dict[str, Any]
) -> None:
    policy = agent_stack.policy
    policy.knobs = Knobs(hold=True)
    replies: list[requests.Response] = []
    url = f"{agent_stack.agent_urls[WEATHER_AGENT]}/run"
    worker = threading.Thread(
        target=lambda: replies.append(http.post(url, json=weather_row, timeout=TIMEOUT))
    )
    worker.start()
    deadline = time.monotonic() + 60
    while not policy.in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    held = policy.in_flight()
    assert [c.path for c in held] == ["/v1/chat/completions"]
    assert worker.is_alive() and not replies  # the rollout waits on the held model call
    policy.knobs = Knobs()
    policy.release()
    worker.join(timeout=TIMEOUT)
    assert replies and replies[0].status_code == 200
    assert replies[0].json()["reward"] == 1.0
    assert held[0].status == 200 and not held[0].closed_by_client


def test_a_held_call_records_that_its_client_closed_it(agent_stack: AgentStack) -> None:
    """The hold knob against the policy itself: a client that gives up closes the connection,
    and the policy's log says so."""
    policy = agent_stack.policy
    policy.reset()
    policy.knobs = Knobs(hold=True)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with requests.Session() as session, pytest.raises(requests.Timeout):
        session.trust_env = False
        session.post(f"{policy.base_url}/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 30
    while not policy.calls[-1].closed_by_client and time.monotonic() < deadline:
        time.sleep(0.05)
    record = policy.calls[-1]
    assert (record.closed_by_client, record.status, record.reply) == (True, None, None)
    policy.reset()


def test_a_delayed_policy_delays_every_model_call(
    agent_stack: AgentStack, http: requests.Session, weather_row: dict[str, Any]
) -> None:
    agent_stack.policy.knobs = Knobs(delay=0.3)
    reply = http.post(
        f"{agent_stack.agent_urls[WEATHER_AGENT]}/run", json=weather_row, timeout=TIMEOUT
    )
    assert reply.status_code == 200 and reply.json()["reward"] == 1.0
    calls = agent_stack.policy.chat_calls()
    assert len(calls) == 2
    # each call was answered no sooner than its scripted delay (a lower bound the policy sets)
    assert all(c.finished is not None and c.finished - c.started >= 0.3 for c in calls)


@pytest.mark.parametrize("route", ["agent", pytest.param("episode", marks=pytest.mark.nemo_gym_07)])
def test_a_client_that_gives_up_closes_the_policy_call_from_0_7_on(
    agent_stack: AgentStack, http: requests.Session, weather_row: dict[str, Any], route: str
) -> None:
    """0.7 closes its model call when the caller of `/run` disconnects (nemo_gym.server_utils
    cancels a request whose client went away): the close travels agent (or environment server)
    -> vllm_model -> the policy, whose log records it. 0.4.0 has no such cancellation: the held
    call stays open (checked for CLOSE_WAIT s) until released."""
    closes = version_tuple(agent_stack.version) >= (0, 7)
    policy = agent_stack.policy
    policy.knobs = Knobs(hold=True)
    if route == "agent":
        url, body = f"{agent_stack.agent_urls[WEATHER_AGENT]}/run", weather_row
    else:
        url = f"{agent_stack.environment_urls[EPISODE_SERVER]}/run"
        body = _episode(weather_row, "given-up-0")
    with pytest.raises(requests.Timeout):
        http.post(url, json=body, timeout=3)  # held: no answer, the client gives up
    deadline = time.monotonic() + (30 if closes else CLOSE_WAIT)
    while not any(c.closed_by_client for c in policy.calls) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(c.path, c.status, c.closed_by_client) for c in policy.calls] == [
        ("/v1/chat/completions", None, closes)
    ]
