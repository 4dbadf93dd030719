"""`NemoGymEnv` in real skyrl-gym 0.4.0, made by `skyrl_gym.make` as SkyRL's generator makes its
envs and driven as its agent loop drives them (`init`, then `step` with the model's text until
`done`, then `close`; many episodes at once on a thread pool, as its `max_env_workers` runs
them), against real NeMo Gym servers (the default stack: 0.7.0, and 0.4.0 in `make test`'s
second phase) through a real bridge. The model's turns are written by the test: no LLM runs
here, and skyrl 0.4.0 itself (its generator) needs Python >= 3.12 and torch (docs/skyrl.md).
A FaultProxy in front of example_single_tool_call fails a tool call and a verify on demand.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.support.missing import missing

try:
    import skyrl_gym
except ImportError as exc:
    missing(f"skyrl-gym is not installed ({exc}); pip install '.[skyrl]'", module_level=True)

from nemo_gym_grpc.rewards.skyrl import register
from nemo_gym_grpc.rewards.skyrl.env import NemoGymEnvError
from tests.support import example_rows, start_bridge
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.versions import selected_version
from tests.support.waiting import wait_until

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0

WEATHER = "example_single_tool_call"
ON_07 = selected_version().startswith("0.7")
COUNTER = "example_session_state_mgmt"


def call(name: str, **arguments: Any) -> str:
    """A model turn that calls `name` (the Hermes format NemoGymEnv reads)."""
    body = json.dumps({"name": name, "arguments": arguments})
    return f"Let me check.\n<tool_call>\n{body}\n</tool_call>"


def make(target: str, server: str, row: dict[str, Any]) -> Any:
    """A NemoGymEnv made by skyrl_gym from one dataset row's extras."""
    register()
    extras = {"nemo_gym_row": json.dumps(row), "resources_server": server, "max_turns": 4}
    return skyrl_gym.make("nemo_gym", env_config={"bridge": target}, extras=extras)


def episode(env: Any, turns: list[str]) -> tuple[list[dict], float]:
    """Drive `env` as SkyRL's agent loop does; (the observations, the final reward)."""
    prompt, _ = env.init([{"role": "user", "content": "..."}])
    assert prompt[0]["role"] == "user"
    seen: list[dict] = []
    try:
        for text in turns:
            out = env.step(text)
            seen += out["observations"]
            if out["done"]:
                return seen, out["reward"]
        raise AssertionError("the episode did not end")
    finally:
        env.close()


@pytest.fixture(scope="module")
def proxy(nemo_gym) -> Iterator[FaultProxy]:
    with FaultProxy(nemo_gym.server_urls[WEATHER]) as started:
        yield started


@pytest.fixture(scope="module")
def target(nemo_gym, proxy) -> Iterator[str]:
    args = ("--head-url", nemo_gym.head_url, "--server", f"{WEATHER}={proxy.url}")
    with start_bridge(*args) as bridge:
        yield bridge.target


def without_call() -> float:
    """example_single_tool_call's reward for a response without a get_weather call: 0.0 on
    0.7, whose /verify checks for one; 0.4's answers 1.0 to any response."""
    return 0.0 if ON_07 else 1.0


def test_a_tool_episode_is_scored_on_its_function_calls(target, nemo_gym_venv):
    row = example_rows(WEATHER, nemo_gym_venv)[0]
    seen, reward = episode(make(target, WEATHER, row), [call("get_weather", city="sf"), "Sunny."])
    assert [m["role"] for m in seen] == ["tool"]
    assert "sf" in json.loads(seen[0]["content"])["city"]
    assert reward == 1.0
    _, reward = episode(make(target, WEATHER, row), ["I will not look it up."])
    assert reward == without_call()


def test_sixteen_counter_episodes_at_once_each_see_their_own_session(target, nemo_gym_venv):
    # example_session_state_mgmt keeps a counter per session: 1.0 when it ends at expected_count
    row = example_rows(COUNTER, nemo_gym_venv)[0]
    add = row["expected_count"] - row["initial_count"]

    def one(k: int) -> float:
        turns = [call("increment_counter", count=add if k % 2 == 0 else add + 1), "Done."]
        return episode(make(target, COUNTER, row), turns)[1]

    with ThreadPoolExecutor(16) as pool:
        rewards = list(pool.map(one, range(16)))
    assert rewards == [1.0, 0.0] * 8


def test_a_single_turn_episode_scores_its_answer(target, nemo_gym_venv):
    row = next(r for r in example_rows("mcqa", nemo_gym_venv) if r["expected_answer"] == "B")
    assert episode(make(target, "mcqa", row), ["\\boxed{B}"])[1] == 1.0
    assert episode(make(target, "mcqa", row), ["\\boxed{E}"])[1] == 0.0


def test_the_models_mistakes_are_answered_to_it_and_the_episode_goes_on(target, nemo_gym_venv):
    row = example_rows(WEATHER, nemo_gym_venv)[0]
    env = make(target, WEATHER, row)
    turns = [call("get_forecast", city="sf"), "<tool_call>{oops</tool_call>", "Sunny."]
    seen, reward = episode(env, turns)
    assert "NOT_FOUND (UNKNOWN_TOOL)" in seen[0]["content"]
    assert "not JSON" in seen[1]["content"]
    assert reward == without_call()  # the only call was to a tool the server lacks
    assert env.get_metrics() == {"turns": 3, "tool_calls": 1, "tool_mistakes": 2}


def test_a_tool_or_verify_the_server_fails_raises_and_the_session_is_closed(
    target, proxy, nemo_gym_venv
):
    row = example_rows(WEATHER, nemo_gym_venv)[0]
    closes = 1 if ON_07 else 0  # 0.4 has no /close_session
    proxy.set_faults(Fault("status", path="/get_weather", status=500))  # counters zeroed
    try:
        error = failing(make(target, WEATHER, row), [call("get_weather", city="sf"), "Sunny."])
        assert error.step == "tool" and error.failure.code == "INTERNAL"
        wait_until(lambda: closed(proxy) == closes, 10, "the session closed upstream")
        proxy.set_faults(Fault("status", path="/verify", status=503))
        error = failing(make(target, WEATHER, row), ["Sunny."])
        assert error.step == "verify"
        wait_until(lambda: closed(proxy) == closes, 10, "the session closed upstream")
    finally:
        proxy.set_faults()


def failing(env: Any, turns: list[str]) -> NemoGymEnvError:
    """Drive `env` as SkyRL's agent loop does until a step raises (the loop then never calls
    `close`: the env must have closed its session itself); what it raised."""
    env.init([{"role": "user", "content": "..."}])
    with pytest.raises(NemoGymEnvError) as raised:
        for text in turns:
            env.step(text)
    return raised.value


def closed(proxy: FaultProxy) -> int:
    """The `/close_session` calls the proxy passed on for the sessions it saw seeded since its
    counters were zeroed: an earlier test's close, sent in the background after its episode,
    may arrive after that and is not this test's."""
    seeded = {session for path, session in proxy.posts if path.endswith("/seed_session")}
    return sum(
        n
        for (path, session), n in proxy.posts.items()
        if path.endswith("/close_session") and session in seeded
    )
