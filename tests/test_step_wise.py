"""NeMo Gym 0.7's step-wise resources servers (`GymnasiumServer`: `/reset` and `/step`, no
`/seed_session` or `/verify`: blackjack, wordle, ...) through the bridge, real servers:

- `nemo-gym-grpc score` on each one's own example_rollouts.jsonl scores every row as a one-step
  episode (`/reset` with the row, `/step` with the row and its response, in one session);
  before, every row failed and the run exited 1;
- `ListResourcesServers` says which servers are step-wise;
- a session on one is an episode: OpenSession resets it (the observation is the seed reply,
  `step_wise` set), `Step` acts until it terminates, which closes the session; `VerifySession`
  there, or `Step` on a server that is not step-wise (mcqa), fails NOT_STEP_WISE;
- SkyRL's `NemoGymEnv` (real skyrl-gym) plays such an episode as NeMo Gym's gymnasium agent
  does: the observations as `user` turns, each step's reward, done when the server ends it or
  at `max_turns`. The model's turns are written by the test (no LLM runs here).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from nemo_gym_grpc.rewards.client.sessions import SessionClient, SessionError
from nemo_gym_grpc.v1 import session_pb2, verify_pb2, verify_pb2_grpc
from tests.support import NemoGymServers, resources_server_dir, start_bridge
from tests.support.items import mcqa_row
from tests.support.missing import missing
from tests.test_score import score_example_rollouts

pytestmark = pytest.mark.nemo_gym_07  # step-wise servers are new in 0.7

# indian_banking, step-wise too, is not among them: its config requires an LLM user simulator
# and judge model server (`user_simulator_model`), which cannot run here.
STEP_WISE = ("blackjack", "wordle", "openair_congestion", "example_multi_turn_gymnasium")
# wordle's saved rollouts lack the row's `custom_target` (the word), which its `/reset` needs:
# every row gets the server's own HTTP 400, typed, and the run goes on.
NO_TARGET = "Invalid or missing custom_target"


@pytest.fixture(scope="module")
def step_gym(nemo_gym_venv) -> Iterator[NemoGymServers]:
    with NemoGymServers((*STEP_WISE, "mcqa"), venv=nemo_gym_venv) as gym:
        yield gym


@pytest.fixture(scope="module")
def bridge(step_gym) -> Iterator:
    with start_bridge("--head-url", step_gym.head_url) as started:
        yield started


def first_row(server: str) -> dict:
    """The first row of `server`'s data/example.jsonl."""
    path = resources_server_dir(server) / "data" / "example.jsonl"
    return json.loads(path.read_text().splitlines()[0])


@pytest.mark.parametrize("server", STEP_WISE)
def test_score_scores_a_step_wise_servers_saved_rollouts(step_gym, server, tmp_path):
    records = score_example_rollouts(server, step_gym.head_url, tmp_path)  # /step's fields
    errors = [r["error"] for r in records if r["error"]]
    if server == "wordle":
        assert len(errors) == len(records)
        assert all(e["reason"] == "UPSTREAM_SESSION_FAILED" for e in errors)
        assert all("/reset answered HTTP 400" in e["message"] and NO_TARGET in e["message"]
                   for e in errors)  # fmt: skip
        return
    assert errors == []
    assert all(isinstance(r["reward"], float) for r in records)


def test_step_wise_servers_are_listed_as_such(bridge):
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        reply = stub.ListResourcesServers(verify_pb2.ListResourcesServersRequest(), timeout=30)
        servers = {s.name: s for s in reply.resources_servers}
    assert all(s.capabilities_known for s in servers.values()), servers
    assert {name for name, s in servers.items() if s.step_wise} == set(STEP_WISE)
    assert list(servers["blackjack"].tools) == []  # /reset and /step are not tools


def test_a_blackjack_episode_in_a_session(bridge):
    row = first_row("blackjack")
    with SessionClient(bridge.target) as client, client.open("blackjack", row) as session:
        assert session.step_wise and "Your hand" in session.seed_reply["observation"]
        with pytest.raises(SessionError) as refused:
            session.verify(completion="<action>stand</action>", row=row)
        assert refused.value.failure.reason == "NOT_STEP_WISE"
        steps = []
        for _ in range(12):  # hit until the hand ends (a bust) or 11 cards, then stand
            action = "hit" if len(steps) < 11 else "stand"
            steps.append(session.step(completion=f"<action>{action}</action>", row=row))
            if steps[-1].terminated:
                break
        with pytest.raises(SessionError) as gone:  # the episode ended, and its session
            session.step(completion="<action>stand</action>", row=row)
        assert gone.value.failure.reason == "SESSION_NOT_FOUND"
        assert session.close() is False
    *going, last = steps
    assert all(s.observation and s.reward == 0.0 and not s.terminated for s in going)
    assert last.terminated and not last.HasField("observation")
    assert last.reward in (-1.0, 0.0, 1.0)
    assert json.loads(last.info_json)["result"] in ("bust", "win", "draw", "loss")


def test_step_on_a_session_that_is_not_step_wise_fails_not_step_wise(bridge):
    with SessionClient(bridge.target) as client, client.open("mcqa", mcqa_row()) as session:
        assert not session.step_wise
        with pytest.raises(SessionError) as refused:
            session.step(completion="\\boxed{A}", row=mcqa_row())
    assert refused.value.failure.reason == "NOT_STEP_WISE"


def skyrl_env(target: str, server: str, row: dict, max_turns: int) -> Any:
    """A NemoGymEnv made by real skyrl_gym, as SkyRL's generator makes its envs."""
    try:
        import skyrl_gym

        from nemo_gym_grpc.rewards.skyrl import register
    except ImportError as exc:
        missing(f"skyrl-gym is not installed ({exc}); pip install '.[skyrl]'")
    register()
    extras = {"nemo_gym_row": row, "resources_server": server, "max_turns": max_turns}
    return skyrl_gym.make("nemo_gym", env_config={"bridge": target}, extras=extras)


def test_skyrl_plays_a_multi_turn_episode_and_gets_each_steps_reward(bridge):
    row = first_row("example_multi_turn_gymnasium")  # France; two follow-ups; "Eiffel"
    env = skyrl_env(bridge.target, "example_multi_turn_gymnasium", row, max_turns=8)
    prompt, _ = env.init([{"role": "user", "content": "What is the capital of France?"}])
    assert len(prompt) == 1  # this server's /reset has no observation
    outs = [env.step(text) for text in ("Paris.", "About 2 million.", "The Eiffel Tower.")]
    assert [o["observations"] for o in outs] == [
        [{"role": "user", "content": row["follow_ups"][0]}],
        [{"role": "user", "content": row["follow_ups"][1]}],
        [],
    ]
    assert [(o["reward"], o["done"]) for o in outs] == [(0.0, False), (0.0, False), (1.0, True)]
    assert outs[-1]["metadata"]["terminated"]
    wrong = skyrl_env(bridge.target, "example_multi_turn_gymnasium", row, max_turns=8)
    wrong.init([])
    assert [wrong.step("No idea.")["reward"] for _ in range(3)] == [0.0, 0.0, 0.0]


def test_skyrl_adds_the_first_observation_and_ends_at_the_servers_end(bridge):
    env = skyrl_env(bridge.target, "blackjack", first_row("blackjack"), max_turns=16)
    prompt, _ = env.init([{"role": "user", "content": "Deal me in."}])
    assert prompt[-1]["role"] == "user" and "Your hand" in prompt[-1]["content"]
    outs = [env.step("<action>hit</action>")]
    while not outs[-1]["done"]:  # hitting busts the hand long before max_turns (16)
        assert outs[-1]["observations"][0]["content"].startswith("Your hand")
        outs.append(env.step("<action>hit</action>"))
    assert outs[-1]["reward"] == -1.0 and outs[-1]["metadata"]["info"]["result"] == "bust"
    assert all(o["reward"] == 0.0 for o in outs[:-1])


def test_skyrl_sends_the_models_tool_calls_for_the_server_to_run(bridge):
    # openair_congestion takes exactly one tool call per step, else a penalized noop
    row = first_row("openair_congestion")
    env = skyrl_env(bridge.target, "openair_congestion", row, max_turns=8)
    env.init([])
    body = json.dumps({"name": "noop", "arguments": {}})
    called = env.step(f"Holding steady.\n<tool_call>{body}</tool_call>")
    output, observation = called["observations"]
    assert output["role"] == "tool" and json.loads(output["content"])["accepted"] is True
    assert observation["role"] == "user" and observation["content"]
    assert "error" not in called["metadata"]["info"]
    for text in ("I will wait.", "<tool_call>{oops</tool_call>"):  # no call reaches the server
        out = env.step(text)
        info = out["metadata"]["info"]
        assert info["error"] == "no_tool_call" and info["reward_terms"]["protocol_violation"] < 0
    assert "not JSON" in out["observations"][0]["content"]  # the model's mistake, told
    assert env.get_metrics() == {"turns": 3, "tool_calls": 1, "tool_mistakes": 1}
    env.close()


def test_skyrl_cuts_the_episode_at_max_turns_and_closes_its_session(bridge):
    row = first_row("example_multi_turn_gymnasium")
    env = skyrl_env(bridge.target, "example_multi_turn_gymnasium", row, max_turns=2)
    env.init([])
    session_id = env.session.id
    assert env.step("Paris.")["done"] is False
    last = env.step("About 2 million.")
    assert last["done"] and last["observations"] == [] and not last["metadata"]["terminated"]
    with SessionClient(bridge.target) as client:  # the bridge holds it no longer
        reply = client.stub.CloseSession(session_pb2.CloseSessionRequest(session_id=session_id))
    assert reply.closed is False


def test_skyrl_raises_when_the_step_wise_session_is_lost(bridge):
    env = skyrl_env(bridge.target, "blackjack", first_row("blackjack"), max_turns=16)
    env.init([])
    with SessionClient(bridge.target) as client:  # as if its lease ran out
        client.stub.CloseSession(session_pb2.CloseSessionRequest(session_id=env.session.id))
    from nemo_gym_grpc.rewards.skyrl.env import NemoGymEnvError

    with pytest.raises(NemoGymEnvError) as raised:
        env.step("<action>stand</action>")
    assert raised.value.step == "step" and raised.value.failure.reason == "SESSION_NOT_FOUND"
