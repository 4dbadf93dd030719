"""Step-wise NeMo Gym servers in the verifiers 0.4 taskset (`BridgeEnv`,
rewards/verifiers/episodes.py) as prime-rl runs it: real verifiers 0.4.0's env server
(`serve_env` in a process of its own) and client (`EnvClient`), real NeMo Gym 0.7 step-wise
servers (example_multi_turn_gymnasium behind a FaultProxy, blackjack, openair_congestion)
through a real bridge:

- an example_multi_turn_gymnasium episode gets the server's follow-ups as `user` turns and is
  rewarded the sum of its steps' (1.0 when the last answer names what the row expects);
- a blackjack episode opens with the dealt hand (the `/reset` observation) and ends when the
  server ends the hand;
- an openair_congestion tool call (its row's tools) is a step the server runs, its output the
  call's result;
- a `/step` the server fails errors the trace (no reward), and its session is closed;
- a bridge that cannot be reached errors the trace in the task's setup, typed, as before
  (asking whether the server is step-wise does not end the episode without a trace).

The harness and the policy model are scripted (tests/support/vf_harness.py says why); the
policy answers each user turn by a substring of it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import NemoGymServers, start_bridge
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.missing import missing
from tests.support.policy_model import Knobs, ScriptedPolicy
from tests.support.procs import closed_port
from tests.support.prometheus_scrape import no_open_sessions
from tests.support.vf_env import Served, run_episodes, served_examples

pytestmark = pytest.mark.nemo_gym_07  # step-wise servers are new in 0.7

MULTI_TURN = "example_multi_turn_gymnasium"
ANSWERS = [
    ("capital of France", "Paris."),
    ("population", "About 2.1 million."),
    ("landmark", "The Eiffel Tower."),
    ("multiplied", "120."),
    ("divide", "I do not know."),  # the row expects "20": reward 0.0
    ("Your hand", "<action>stand</action>"),
]


@pytest.fixture(autouse=True, scope="module")
def _verifiers_installed() -> None:
    try:
        import verifiers.v1  # noqa: F401
    except ImportError as exc:
        missing(f"verifiers is not installed ({exc}); pip install '.[verifiers]'")


@pytest.fixture(scope="module")
def gym(nemo_gym_venv) -> Iterator[NemoGymServers]:
    servers = (MULTI_TURN, "blackjack", "openair_congestion")
    with NemoGymServers(servers, venv=nemo_gym_venv) as started:
        yield started


@pytest.fixture(scope="module")
def proxy(gym) -> Iterator[FaultProxy]:
    with FaultProxy(gym.server_urls[MULTI_TURN]) as started:
        yield started


@pytest.fixture(scope="module")
def bridge(gym, proxy) -> Iterator:
    args = ("--head-url", gym.head_url, "--server", f"{MULTI_TURN}={proxy.url}")
    with start_bridge(*args, "--metrics-port", "0") as started:
        yield started


@pytest.fixture(scope="module")
def policy() -> Iterator[ScriptedPolicy]:
    with ScriptedPolicy(answers=ANSWERS) as started:
        yield started


@pytest.fixture
def serve(nemo_gym_venv: Path, bridge) -> Iterator[Callable[[str], Served]]:
    """serve(resources server) -> a Served env server of our taskset over its example rows."""
    started: list[Served] = []

    def start(server: str) -> Served:
        started.append(served_examples(bridge.target, server, nemo_gym_venv))
        return started[-1]

    yield start
    for served in started:
        served.stop()


def user_turns(trace) -> list[str]:
    return [m.content for m in trace.messages if m.role == "user"]


def test_an_episode_takes_the_servers_turns_and_sums_its_steps_rewards(bridge, policy, serve):
    served = serve(MULTI_TURN)
    france, arithmetic = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:2]))
    for trace in (france, arithmetic):
        assert trace.ok and not trace.errors, trace.errors
        assert trace.metrics["nemo_gym/truncated"] == 0.0
    assert user_turns(france) == [
        "What is the capital of France?",
        "What is the approximate population of that city?",
        "Name one famous landmark there.",
    ]
    assert (france.reward, france.metrics["nemo_gym/steps"]) == (1.0, 3.0)
    assert user_turns(arithmetic)[1] == "Now divide that result by 6."
    assert (arithmetic.reward, arithmetic.metrics["nemo_gym/steps"]) == (0.0, 2.0)
    no_open_sessions(bridge)


def test_an_episode_opens_with_the_first_observation(bridge, policy, serve):
    served = serve("blackjack")
    (trace,) = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:1]))
    assert trace.ok and not trace.errors, trace.errors
    assert user_turns(trace)[-1].startswith("Your hand")  # after the row's "Deal me in."
    assert trace.metrics["nemo_gym/steps"] == 1.0  # it stood: the hand is over
    assert trace.reward in (-1.0, 0.0, 1.0)
    no_open_sessions(bridge)


def test_a_tool_call_is_a_step_the_server_runs(bridge, policy, serve):
    # openair_congestion's row offers its actions as tools; the policy calls `noop` once
    policy.knobs = Knobs(tool_name="noop", tool_arguments="{}")
    served = serve("openair_congestion")
    try:
        (trace,) = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:1]))
    finally:
        policy.reset()
    assert trace.ok and not trace.errors, trace.errors
    (called, *_) = [m for m in trace.messages if m.role == "tool"]
    assert json.loads(str(called.content).splitlines()[0])["accepted"] is True  # its output
    assert trace.metrics["nemo_gym/steps"] >= 2  # the call's step, then the reply's
    no_open_sessions(bridge)


def test_a_step_the_server_fails_errors_the_trace(bridge, proxy, policy, serve):
    served = serve(MULTI_TURN)
    proxy.set_faults(Fault("status", path="/step", status=500))
    try:
        (trace,) = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:1]))
    finally:
        proxy.set_faults()
    assert not trace.ok
    assert [e.type for e in trace.errors] == ["TaskError"]
    assert trace.rewards["nemo_gym"] is None
    assert trace.info["nemo_gym"]["step"] == "step"
    assert trace.info["nemo_gym"]["failure"].startswith("INTERNAL")
    no_open_sessions(bridge)


def test_a_bridge_that_cannot_be_reached_errors_the_trace_as_before(policy, nemo_gym_venv):
    served = served_examples(f"127.0.0.1:{closed_port()}", MULTI_TURN, nemo_gym_venv)
    try:
        (trace,) = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:1]))
    finally:
        served.stop()
    assert not trace.ok and [e.type for e in trace.errors] == ["TaskError"]
    assert trace.info["nemo_gym"] == {"step": "tools", "failure": "UNAVAILABLE"}  # setup's
