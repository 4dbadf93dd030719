"""The verifiers 0.4 taskset (nemo_gym_grpc.rewards.verifiers, id `nemo-gym-grpc-verifiers`) as
prime-rl's orchestrator runs it: real verifiers 0.4.0's env server (`serve_env`, in a process of
its own, as prime-rl runs one per source) and its client (`EnvClient`, ZMQ on loopback),
episodes of NeMo Gym's own example rows through a real bridge to real NeMo Gym 0.7 resources
servers of the agent stack (tests/support/agents.py): example_single_tool_call (a session with
a tool; behind a FaultProxy, which counts the session calls and injects faults) and
math_with_judge (whose judge answers 503: a masked sample); and example_tool_call_multireward
(reward_components) and mcqa (one turn, graded by the letter it boxes) of the default stack;
and example_mcp_weather (rows without tools: the taskset offers the ones the bridge lists).
The harness and the policy model are scripted (tests/support/vf_harness.py says why)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import NemoGymServers, start_bridge
from tests.support.agents import MASKED_RESOURCES, WEATHER_RESOURCES
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.missing import missing
from tests.support.policy_model import Knobs, ScriptedPolicy
from tests.support.prometheus_scrape import no_open_sessions
from tests.support.vf_env import Served, run_episodes, served_examples

pytestmark = pytest.mark.nemo_gym_07  # the masked judge failure is 0.7's judge_failsafe


@pytest.fixture(autouse=True, scope="module")
def _verifiers_installed() -> None:
    """verifiers, the taskset's dependency, checked before anything needs it (not at import:
    collecting the tests need not spend its 2 s)."""
    try:
        import verifiers.v1  # noqa: F401
    except ImportError as exc:
        missing(f"verifiers is not installed ({exc}); pip install '.[verifiers]'")


@pytest.fixture(scope="module")
def proxy(agent_stack) -> Iterator[FaultProxy]:
    with FaultProxy(agent_stack.resources_urls[WEATHER_RESOURCES]) as started:
        yield started


def bridge_args(agent_stack, proxy: FaultProxy, *more: str) -> tuple[str, ...]:
    """The bridge's arguments: the agent stack's servers, the weather one through `proxy`."""
    weather = f"{WEATHER_RESOURCES}={proxy.url}"
    return ("--head-url", agent_stack.head_url, "--server", weather, *more)


@pytest.fixture(scope="module")
def bridge(agent_stack, proxy) -> Iterator:
    with start_bridge(*bridge_args(agent_stack, proxy, "--metrics-port", "0")) as started:
        yield started


@pytest.fixture
def policy(agent_stack) -> Iterator[ScriptedPolicy]:
    """The agent stack's scripted policy, its knobs restored after the test."""
    yield agent_stack.policy
    agent_stack.policy.reset()


@pytest.fixture
def serve(nemo_gym_venv: Path) -> Iterator[Callable[[str, str], Served]]:
    """serve(bridge target, resources server) -> a Served env server of our taskset over
    `server`'s example rows, stopped after the test."""
    started: list[Served] = []

    def start(target: str, server: str) -> Served:
        started.append(served_examples(target, server, nemo_gym_venv))
        return started[-1]

    yield start
    for served in started:
        served.stop()


def session_posts(proxy: FaultProxy, path: str) -> int:
    """POSTs to `path` the weather server got through the proxy."""
    return sum(n for (posted, _), n in proxy.posts.items() if posted == path)


def posts_reach(proxy: FaultProxy, path: str, count: int, timeout: float = 60.0) -> int:
    """Wait (at most `timeout` s) until `session_posts(proxy, path)` reaches `count`; returns
    it then (or when the time is up)."""
    deadline = time.monotonic() + timeout
    while session_posts(proxy, path) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return session_posts(proxy, path)


def test_episodes_call_their_tool_in_their_session_and_are_scored_in_it(
    bridge, proxy, policy, serve
):
    served = serve(bridge.target, WEATHER_RESOURCES)
    seeds, closes = session_posts(proxy, "/seed_session"), session_posts(proxy, "/close_session")
    traces = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:4]))
    for trace in traces:
        assert trace.ok and not trace.errors, trace.errors
        assert trace.reward == 1.0
        assert [m.role for m in trace.messages].count("tool") == 1
    no_open_sessions(bridge)
    assert session_posts(proxy, "/seed_session") - seeds == 4
    assert session_posts(proxy, "/get_weather") >= 4
    assert session_posts(proxy, "/close_session") - closes == 4


def test_a_masked_sample_is_an_errored_trace_never_a_reward(bridge, policy, serve):
    served = serve(bridge.target, MASKED_RESOURCES)
    for trace in asyncio.run(run_episodes(served.address, policy.base_url, served.data[:2])):
        # errored (prime-rl leaves it out of training), with NeMo Gym's failure in its info
        assert not trace.ok
        assert [e.type for e in trace.errors] == ["TaskError"]
        assert "UPSTREAM_JUDGE_FAILED" in trace.errors[0].message
        assert trace.rewards["nemo_gym"] is None
        failure = trace.info["nemo_gym"]
        assert failure["failureKind"] == "judge_failed" and failure["step"] == "verify"
    no_open_sessions(bridge)


def test_a_tool_call_the_server_fails_errors_its_trace(bridge, proxy, policy, serve):
    served = serve(bridge.target, WEATHER_RESOURCES)
    proxy.set_faults(Fault("status", match=b'"city": "sf"', status=500, times=2))
    try:
        traces = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:4]))
    finally:
        proxy.set_faults()
    failed = [t for t in traces if not t.ok]
    assert len(failed) == 2
    for trace in failed:
        assert trace.info["nemo_gym"]["step"] == "tool"
        assert trace.rewards["nemo_gym"] is None
    assert [t.reward for t in traces if t.ok] == [1.0, 1.0]
    no_open_sessions(bridge)


def test_sessions_of_a_killed_env_server_are_closed_upstream(agent_stack, proxy, policy, serve):
    args = bridge_args(agent_stack, proxy, "--metrics-port", "0", "--session-lease", "2")
    with start_bridge(*args) as bridge:
        served = serve(bridge.target, WEATHER_RESOURCES)
        seeds = session_posts(proxy, "/seed_session")
        closes = session_posts(proxy, "/close_session")
        policy.knobs = Knobs(delay=60.0)  # every episode waits on the model when it is killed

        async def killed_mid_episode() -> None:
            episodes = asyncio.ensure_future(
                run_episodes(served.address, policy.base_url, served.data[:4])
            )
            await asyncio.to_thread(posts_reach, proxy, "/seed_session", seeds + 4)
            served.kill()
            episodes.cancel()

        asyncio.run(killed_mid_episode())
        no_open_sessions(bridge)
        assert posts_reach(proxy, "/close_session", closes + 4, timeout=10) == closes + 4


def test_a_bridge_killed_mid_episode_errors_every_trace(agent_stack, proxy, policy, serve):
    with start_bridge(*bridge_args(agent_stack, proxy)) as bridge:
        served = serve(bridge.target, WEATHER_RESOURCES)
        seeds = session_posts(proxy, "/seed_session")
        policy.knobs = Knobs(delay=3.0)

        async def bridge_killed() -> list[Any]:
            episodes = asyncio.ensure_future(
                run_episodes(served.address, policy.base_url, served.data[:4])
            )
            await asyncio.to_thread(posts_reach, proxy, "/seed_session", seeds + 4)
            os.kill(bridge.pid, signal.SIGKILL)
            return await episodes

        traces = asyncio.run(bridge_killed())
    for trace in traces:
        assert not trace.ok and trace.errors
        # no reward: the kill cut its verify, or its OpenSession reply (the seed had reached
        # the server), and then verifiers never scored it
        assert trace.rewards.get("nemo_gym") is None


def test_reward_components_that_sum_to_the_reward_are_the_named_rewards(nemo_gym, policy, serve):
    # example_tool_call_multireward (of the `nemo_gym` stack): reward = correctness +
    # schema_valid + format
    with start_bridge("--head-url", nemo_gym.head_url) as bridge:
        served = serve(bridge.target, "example_tool_call_multireward")
        traces = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:3]))
    for trace in traces:
        assert trace.ok and not trace.errors, trace.errors
        assert set(trace.rewards) == {"correctness", "schema_valid", "format"}
        assert trace.reward == sum(r.score for r in trace.rewards.values())


def test_mcqa_episodes_score_what_nemo_gym_scores_their_answers(nemo_gym, policy, serve):
    # mcqa (of the `nemo_gym` stack): one turn, graded by the letter in the last \boxed{};
    # the scripted policy answers the first and third rows right, the second wrong
    with start_bridge("--head-url", nemo_gym.head_url) as bridge:
        served = serve(bridge.target, "mcqa")
        rows = [data["row"] for data in served.data[:3]]
        letters = [row["expected_answer"] for row in rows]
        letters[1] = "A" if letters[1] != "A" else "B"
        answers = zip(rows, letters, strict=True)
        policy.answers = [(question(row), f"\\boxed{{{x}}}") for row, x in answers]
        traces = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:3]))
    for trace in traces:
        assert trace.ok and not trace.errors, trace.errors
    assert [trace.reward for trace in traces] == [1.0, 0.0, 1.0]


def question(row: dict[str, Any]) -> str:
    """A piece of the row's user message that no other example row of mcqa has."""
    text: str = row["responses_create_params"]["input"][0]["content"]
    return text.split("step-by-step.", 1)[1][:80]


def test_a_row_without_tools_is_offered_the_tools_the_bridge_lists(nemo_gym_venv, policy, serve):
    # example_mcp_weather's rows carry "tools": [] (its own agent lists them over MCP); the
    # policy calls get_weather for Paris: right for the first row, wrong for the second (Tokyo)
    server = "example_mcp_weather"
    with NemoGymServers((server,), venv=nemo_gym_venv) as gym:
        with start_bridge("--head-url", gym.head_url) as bridge:
            served = serve(bridge.target, server)
            policy.knobs = Knobs(tool_arguments=json.dumps({"city": "Paris"}))
            traces = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:2]))
    for trace in traces:
        assert trace.ok and not trace.errors, trace.errors
        assert [m.role for m in trace.messages].count("tool") == 1
    assert [trace.reward for trace in traces] == [1.0, 0.0]
